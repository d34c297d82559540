"""Waiting and requiring in tests, so that a loaded machine cannot fail them and CI cannot skip
them.

- :func:`wait_until` / :func:`eventually`: poll a condition until a deadline, instead of sleeping
  a fixed time and hoping that was enough (on a busy 2-core machine it is not);
  :func:`wait_healthy`: the same for a server process to answer ``GET /health``.
- :func:`require`: a missing test dependency skips the test on a developer's machine and fails
  it where ``CI`` is set, since CI installs every test dependency (``scripts/install --dev``)
  and a skip there would hide a broken setup.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["eventually", "require", "require_binary", "wait_healthy", "wait_until"]

# Generous: the deadline only costs time when the test is failing anyway.
TIMEOUT_S = 10.0
POLL_S = 0.01


def wait_until(condition: Callable[[], object], what: str, *, timeout_s: float = TIMEOUT_S) -> None:
    """Returns once ``condition()`` is true; fails the test (``AssertionError`` naming
    ``what``) when it is still false after ``timeout_s``. For threads and processes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"still not {what} after {timeout_s:g} s")
        time.sleep(POLL_S)


def wait_healthy(url: str, process: subprocess.Popen[Any], *, timeout_s: float = 60.0) -> None:
    """Returns once ``url`` answers ``GET /health`` with 200; fails the test when ``process``
    (what serves it) exits first, or after ``timeout_s``."""
    import httpx

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"{url}: its process exited with status {process.returncode}")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, f"answering at {url}/health", timeout_s=timeout_s)


async def eventually(
    condition: Callable[[], object], what: str, *, timeout_s: float = TIMEOUT_S
) -> None:
    """:func:`wait_until` for the event loop: polls without blocking it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"still not {what} after {timeout_s:g} s")
        await asyncio.sleep(POLL_S)


def require(missing: str | None) -> None:
    """Nothing when ``missing`` is None; else skips the test with ``missing`` as the reason, or
    fails it when ``CI`` is set. ``missing`` says what is absent and how to get it."""
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{missing} (CI is set: a missing test dependency fails)", pytrace=False)
    pytest.skip(missing)


def require_binary(name: str, how_to_get: str) -> str:
    """The path of the executable ``name``; see :func:`require` for when it is missing."""
    path = shutil.which(name)
    require(None if path else f"{name} not found: {how_to_get}")
    assert path is not None
    return path
