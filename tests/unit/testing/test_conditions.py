"""agentkv_server.testing.conditions: polls with deadlines, and skips that CI turns into failures."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agentkv_server.testing.conditions import eventually, require, require_binary, wait_until


def test_wait_until_returns_once_the_condition_holds() -> None:
    done = threading.Event()
    threading.Timer(0.05, done.set).start()

    wait_until(done.is_set, "set")

    assert done.is_set()


def test_wait_until_fails_at_its_deadline_naming_what_it_waited_for() -> None:
    began = time.monotonic()
    with pytest.raises(AssertionError, match="still not set after 0.1 s"):
        wait_until(lambda: False, "set", timeout_s=0.1)
    assert time.monotonic() - began >= 0.1


async def test_eventually_lets_the_loop_run_while_it_waits() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, done.set)

    await eventually(done.is_set, "set")

    with pytest.raises(AssertionError, match="still not cleared"):
        await eventually(lambda: not done.is_set(), "cleared", timeout_s=0.05)


def test_a_missing_dependency_skips_without_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    require(None)
    with pytest.raises(pytest.skip.Exception, match="thing not found"):
        require("thing not found")


def test_a_missing_dependency_fails_where_ci_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    require(None)
    with pytest.raises(pytest.fail.Exception, match="thing not found .CI is set"):
        require("thing not found")
    with pytest.raises(pytest.fail.Exception, match="no-such-binary-agentkv not found: get it"):
        require_binary("no-such-binary-agentkv", "get it")


def test_require_binary_gives_the_path_of_one_that_is_there() -> None:
    assert require_binary("sh", "any POSIX system has one").endswith("/sh")
