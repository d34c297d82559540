"""The pull deadline: an overdue read is aborted through upstream's failure path.

The worker is built bare (no NIXL agent, no engine) with just the state upstream's failure
path touches, so these tests also pin the upstream names the override relies on.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="the worker half subclasses vLLM's NIXL worker")

from agentkv_server.connector.deadlines import Deadlines
from agentkv_server.connector.worker import AgentKVWorker


class FakeNixl:
    def __init__(self, refuse: set[int] = frozenset()) -> None:
        self.released: list[int] = []
        self.refuse = refuse

    def release_xfer_handle(self, handle: int) -> None:
        if handle in self.refuse:
            raise RuntimeError("backend busy")
        self.released.append(handle)


def bare_worker(nixl: FakeNixl) -> AgentKVWorker:
    worker = object.__new__(AgentKVWorker)
    worker.engine_id = "prefill"
    worker.nixl_wrapper = nixl
    worker.xfer_stats = mock.Mock()
    worker._pull_deadlines = Deadlines()
    worker._pull_timeout = 30.0
    worker._recving_transfers = {}
    worker._recving_metadata = {}
    worker._recv_failures = set()
    worker._failed_remote_engines = set()
    return worker


def pulling(worker: AgentKVWorker, req_id: str, handles: list[int], deadline: float) -> None:
    remote = SimpleNamespace(engine_id="decode", request_id="d-" + req_id, host="h", port=1,
                             block_ids=([1, 2],))  # fmt: skip
    worker._recving_metadata[req_id] = SimpleNamespace(local_block_ids=([3, 4],), remote=remote)
    worker._recving_transfers[req_id] = handles
    worker._pull_deadlines.set(req_id, deadline)


def test_overdue_read_is_aborted_and_marked_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    worker = bare_worker(nixl)
    pulling(worker, "late", [11, 12], deadline=0.0)
    pulling(worker, "fresh", [21], deadline=float("inf"))

    worker._abort_overdue_pulls()

    assert nixl.released == [11, 12]
    assert "late" not in worker._recving_transfers
    assert worker._recv_failures == {"late"}
    assert worker._recving_transfers["fresh"] == [21]
    assert "fresh" in worker._pull_deadlines


def test_handles_the_backend_cannot_release_are_kept_with_their_blocks() -> None:
    nixl = FakeNixl(refuse={12})
    worker = bare_worker(nixl)
    pulling(worker, "late", [11, 12], deadline=0.0)

    worker._abort_overdue_pulls()

    assert nixl.released == [11]
    assert worker._recving_transfers["late"] == [12]  # reported only once it drains
    assert worker._recv_failures == {"late"}


def test_pull_still_in_handshake_is_left_to_upstreams_timeout() -> None:
    nixl = FakeNixl()
    worker = bare_worker(nixl)
    pulling(worker, "handshaking", [], deadline=0.0)
    del worker._recving_transfers["handshaking"]  # no read posted yet

    worker._abort_overdue_pulls()

    assert worker._recv_failures == set()
    assert nixl.released == []
