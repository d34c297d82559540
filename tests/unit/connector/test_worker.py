"""Bounded pulls and dead peers: overdue pulls and failed reads end in a recompute at once.

The worker is built bare (no NIXL agent, no engine) with just the state upstream's failure
path touches, so these tests also pin the upstream names the override relies on.
"""

from __future__ import annotations

import inspect
import queue
import time
from types import SimpleNamespace
from unittest import mock

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

from agentkv_server.connector.deadlines import Deadlines
from agentkv_server.connector.syncload import mark_sync_loads
from agentkv_server.connector.worker import PULL_FLOOR_BYTES_PER_SECOND, AgentKVWorker


class FakeNixl:
    """NIXL's wrapper as the worker sees it: per-handle states, releases that may refuse."""

    def __init__(self, refuse: set[int] = frozenset(), states: dict[int, str] | None = None):
        self.released: list[int] = []
        self.refuse = refuse
        self.states = states or {}

    def check_xfer_state(self, handle: int) -> str:
        state = self.states.get(handle, "PROC")
        if state == "DISCONNECT":
            raise RemoteDisconnect("NIXL_ERR_REMOTE_DISCONNECT")
        return state

    def get_xfer_telemetry(self, handle: int) -> None:
        return None

    def release_xfer_handle(self, handle: int) -> None:
        if handle in self.refuse:
            raise RuntimeError("backend busy")
        self.released.append(handle)


class RemoteDisconnect(Exception):
    """Stands in for nixl's ``nixlRemoteDisconnectError``."""


def bare_worker(nixl: FakeNixl) -> AgentKVWorker:
    worker = object.__new__(AgentKVWorker)
    worker.engine_id = "prefill"
    worker.nixl_wrapper = nixl
    worker.xfer_stats = mock.Mock()
    worker._pull_deadlines = Deadlines()
    worker._pull_timeout = 30.0
    worker._abandoned = Deadlines()
    worker._quarantine = Deadlines()
    worker._dead_peer_seconds = 10.0
    worker._peer_probe = None
    worker._recving_transfers = {}
    worker._recving_metadata = {}
    worker._recv_failures = set()
    worker._failed_remote_engines = set()
    worker._invalid_remote_engines = set()
    worker._invalid_engine_backoff = {}
    worker._remote_agents = {"decode": {(0, 0): "agent-d"}}
    worker.block_len_per_layer = []
    worker._sync_load_timeout = 0.05
    worker._ready_requests = queue.Queue()
    worker._pending_recv_notifs = {}
    worker._invalid_block_ids = queue.Queue()
    worker.enable_permute_local_kv = worker.enable_heterogeneous_attn_post_process = False
    worker._physical_blocks_per_logical_kv_block = 1
    worker.transfer_topo = FakeTopology(remote_block_size=16, local_block_size=16)
    return worker


class FakeTopology:
    """What the worker knows of each handshaken peer's layout."""

    def __init__(self, remote_block_size: int, local_block_size: int) -> None:
        self.remote_block_size, self.local_block_size = remote_block_size, local_block_size

    def get_engine_info(self, engine_id: str) -> SimpleNamespace:
        return SimpleNamespace(
            remote_block_size=self.remote_block_size, remote_physical_blocks_per_logical=1
        )

    def block_size_ratio(self, remote_block_size: int) -> int:
        return self.local_block_size // remote_block_size


def pulling(
    worker: AgentKVWorker,
    req_id: str,
    handles: list[int] | None,
    deadline: float = float("inf"),
    engine: str = "decode",
) -> SimpleNamespace:
    """Register a pull from ``engine``; ``handles=None`` is a pull still in its handshake."""
    remote = SimpleNamespace(engine_id=engine, request_id="d-" + req_id, host="h", port=1,
                             block_ids=([1, 2],))  # fmt: skip
    meta = SimpleNamespace(local_block_ids=([3, 4],), remote=remote)
    worker._recving_metadata[req_id] = meta
    if handles is not None:
        worker._recving_transfers[req_id] = handles
    worker._pull_deadlines.set(req_id, deadline)
    return meta


def test_overdue_read_is_aborted_and_marked_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = FakeNixl()
    worker = bare_worker(nixl)
    worker._remote_agents["other"] = {(0, 0): "agent-o"}
    pulling(worker, "late", [11, 12], deadline=0.0)
    pulling(worker, "fresh", [21], deadline=float("inf"), engine="other")

    worker._abort_overdue_pulls()

    assert nixl.released == [11, 12]
    assert "late" not in worker._recving_transfers
    assert worker._recv_failures == {"late"}
    assert worker._recving_transfers["fresh"] == [21]
    assert "fresh" in worker._pull_deadlines


def test_a_read_that_finished_during_a_long_step_is_not_taken_for_a_stall() -> None:
    # The engine's step outlasted the pull's deadline; its reads completed meanwhile.
    nixl = FakeNixl(states={11: "DONE", 12: "DONE"})
    worker = bare_worker(nixl)
    pulling(worker, "done-late", [11, 12], deadline=0.0)

    worker._abort_overdue_pulls()

    assert worker._recving_transfers == {"done-late": [11, 12]}  # left to upstream's poll
    assert not worker._recv_failures and nixl.released == []
    assert "decode" not in worker._quarantine


def test_a_pull_with_one_read_still_running_past_its_deadline_is_abandoned() -> None:
    nixl = FakeNixl(states={11: "DONE", 12: "PROC"})
    worker = bare_worker(nixl)
    pulling(worker, "half", [11, 12], deadline=0.0)

    worker._abort_overdue_pulls()

    assert worker._recv_failures == {"half"}
    assert "decode" in worker._quarantine


def test_a_stalled_pull_drops_its_peer_and_every_other_pull_from_it() -> None:
    # A live peer whose connection wedged: its reads sit in flight, none fails by itself.
    nixl = FakeNixl()
    worker = bare_worker(nixl)
    worker._remote_agents["other"] = {(0, 0): "agent-o"}
    pulling(worker, "stalled", [1], deadline=0.0)
    pulling(worker, "sibling", [2], deadline=float("inf"))
    pulling(worker, "elsewhere", [3], deadline=float("inf"), engine="other")

    worker._abort_overdue_pulls()

    assert nixl.released == [1, 2]
    assert worker._recv_failures == {"stalled", "sibling"}  # both recompute on this step
    assert worker._recving_transfers == {"elsewhere": [3]}
    assert "decode" in worker._quarantine and "other" not in worker._quarantine
    assert "decode" in worker._invalid_remote_engines  # handshaken afresh after the quarantine


def test_a_pull_gets_its_timeout_plus_time_for_its_bytes() -> None:
    worker = bare_worker(FakeNixl())
    worker._pull_timeout = 5.0
    worker.block_len_per_layer = [1_000_000] * 50  # 50 MB a block
    small = SimpleNamespace(local_block_ids=([1, 2],))
    large = SimpleNamespace(local_block_ids=(list(range(100)), list(range(100))))

    assert worker._pull_allowance(small) == pytest.approx(5.0 + 100e6 / PULL_FLOOR_BYTES_PER_SECOND)
    assert worker._pull_allowance(large) == pytest.approx(5.0 + 10e9 / PULL_FLOOR_BYTES_PER_SECOND)


def test_each_new_pull_is_stamped_with_its_allowance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NixlPullConnectorWorker, "start_load_kv", mock.Mock())
    worker = bare_worker(FakeNixl())
    worker._pull_timeout = 5.0
    worker.block_len_per_layer = [1_000_000] * 50
    meta = SimpleNamespace(local_block_ids=(list(range(100)),))
    metadata = SimpleNamespace(reqs_to_recv={"big": meta}, heartbeat_by_engine={})

    before = time.monotonic()
    worker.start_load_kv(metadata)

    assert worker._pull_deadlines.pop_overdue(before + 14.9) == []  # 5 s + 5 GB at the floor
    assert worker._pull_deadlines.pop_overdue(time.monotonic() + 15.0) == ["big"]


def test_handles_the_backend_cannot_release_are_kept_while_running() -> None:
    nixl = FakeNixl(refuse={12})  # 12 still PROC: it can still write into the blocks
    worker = bare_worker(nixl)
    pulling(worker, "late", [11, 12], deadline=0.0)

    worker._abort_overdue_pulls()

    assert nixl.released == [11]
    assert worker._recving_transfers["late"] == [12]  # reported only once it drains
    assert worker._recv_failures == {"late"}


@pytest.mark.parametrize("state", ["ERR", "DISCONNECT"])
def test_an_ended_transfer_nixl_will_not_release_is_dropped(state: str) -> None:
    nixl = FakeNixl(refuse={12}, states={12: state})
    worker = bare_worker(nixl)
    pulling(worker, "late", [11, 12], deadline=0.0)

    worker._abort_overdue_pulls()

    assert nixl.released == [11]
    assert "late" not in worker._recving_transfers  # reported failed on this very step
    assert worker._recv_failures == {"late"}


def test_remote_disconnect_fails_every_pull_from_that_engine_at_once() -> None:
    # Upstream's own poll sees the error; the release of the errored handle is refused.
    nixl = FakeNixl(refuse={1}, states={1: "DISCONNECT", 2: "PROC"})
    worker = bare_worker(nixl)
    worker._remote_agents["other"] = {(0, 0): "agent-o"}
    pulling(worker, "hit", [1])
    pulling(worker, "sibling", [2])
    pulling(worker, "handshaking", None)
    pulling(worker, "elsewhere", [3], engine="other")

    done, failed = worker._pop_done_transfers(worker._recving_transfers)

    assert done == {"hit"} and failed == {"hit"}  # no handle left: reported now
    assert nixl.released == [2]  # the sibling's read is aborted
    assert worker._recv_failures == {"hit", "sibling", "handshaking"}
    assert "sibling" not in worker._recving_transfers
    assert "handshaking" in worker._abandoned
    assert worker._recving_transfers == {"elsewhere": [3]}
    assert "decode" in worker._quarantine and "other" not in worker._quarantine
    assert "decode" in worker._invalid_remote_engines  # upstream re-handshakes it later


def test_a_read_nixl_refuses_to_post_quarantines_its_peer_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused_post(self: AgentKVWorker, **read: object) -> bool:
        # Upstream's contract: transfer() raised, the request is already reported failed.
        self._handle_failed_transfer(read["request_id"], None, self._recv_failures)
        return False

    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks", refused_post)
    worker = bare_worker(FakeNixl())
    pulling(worker, "refused", [])
    pulling(worker, "sibling", None)
    pulling(worker, "elsewhere", None, engine="other")

    posted = worker._read_blocks(request_id="refused", dst_engine_id="decode")

    assert not posted
    assert "decode" in worker._quarantine and "other" not in worker._quarantine
    assert worker._recv_failures == {"refused", "sibling"}  # the sibling recomputes too
    assert "decode" in worker._invalid_remote_engines


def test_upstream_posts_reads_with_the_arguments_the_override_reads() -> None:
    parameters = inspect.signature(NixlPullConnectorWorker._read_blocks).parameters
    assert {"request_id", "dst_engine_id"} <= parameters.keys()


def test_a_quarantined_peer_gets_no_handshake_or_read(monkeypatch: pytest.MonkeyPatch) -> None:
    upstream_read = mock.Mock()
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", upstream_read)
    worker = bare_worker(FakeNixl())
    worker._quarantine.set("decode", deadline=float("inf"))
    to_dead = pulling(worker, "to-dead", None)
    to_live = pulling(worker, "to-live", None, engine="other")

    worker._read_blocks_for_req("to-dead", to_dead)
    worker._read_blocks_for_req("to-live", to_live)

    upstream_read.assert_called_once_with("to-live", to_live)
    assert worker._recv_failures == {"to-dead"}  # fails on this step: recompute


def test_heartbeats_skip_a_quarantined_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    upstream_start = mock.Mock()
    monkeypatch.setattr(NixlPullConnectorWorker, "start_load_kv", upstream_start)
    worker = bare_worker(FakeNixl())
    worker._quarantine.set("decode", deadline=float("inf"))
    metadata = SimpleNamespace(reqs_to_recv={}, heartbeat_by_engine={"decode": 1, "other": 2})

    worker.start_load_kv(metadata)

    assert metadata.heartbeat_by_engine == {"other": 2}
    upstream_start.assert_called_once_with(metadata)


def test_quarantine_ends_after_dead_peer_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NixlPullConnectorWorker, "start_load_kv", mock.Mock())
    worker = bare_worker(FakeNixl())
    worker._quarantine.set("decode", deadline=time.monotonic() - 1)
    metadata = SimpleNamespace(reqs_to_recv={}, heartbeat_by_engine={"decode": 1})

    worker.start_load_kv(metadata)

    assert "decode" not in worker._quarantine
    assert metadata.heartbeat_by_engine == {"decode": 1}


def test_overdue_handshake_is_abandoned_and_its_late_completion_posts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upstream_read = mock.Mock()
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", upstream_read)
    nixl = FakeNixl()
    worker = bare_worker(nixl)
    meta = pulling(worker, "handshaking", None, deadline=0.0)

    worker._abort_overdue_pulls()
    worker._read_blocks_for_req("handshaking", meta)  # the handshake completes late

    assert worker._recv_failures == {"handshaking"}
    upstream_read.assert_not_called()
    assert nixl.released == []


def test_a_peer_whose_listener_is_gone_fails_its_reads_at_once() -> None:
    nixl = FakeNixl()  # every read still PROC: UCX has not noticed the peer's death
    worker = bare_worker(nixl)
    worker._peer_probe = FakeProbe(dead=["decode"])
    pulling(worker, "stuck", [7])
    pulling(worker, "elsewhere", [8], engine="other")

    worker._probe_read_peers(now=0.0)

    assert nixl.released == [7]
    assert worker._recv_failures == {"stuck"}
    assert "decode" in worker._quarantine
    assert worker._peer_probe.probed == [("other", "h", 1)]  # the quarantined one is failed


class FakeProbe:
    def __init__(self, dead: list[str]) -> None:
        self._dead = dead
        self.probed: list[tuple[str, str, int]] = []

    def dead(self) -> list[str]:
        dead, self._dead = self._dead, []
        return dead

    def probe(self, peer: str, host: str, port: int, now: float) -> None:
        self.probed.append((peer, host, port))


# -- synchronous loads: read before the forward pass, or failed blocks (connector/syncload.py) --


def invalid_blocks(worker: AgentKVWorker) -> set[int]:
    return worker.get_block_ids_with_load_errors()


def test_a_synchronous_load_whose_reads_are_done_is_over_before_the_forward_pass() -> None:
    nixl = FakeNixl(states={11: "DONE", 12: "DONE"})
    worker = bare_worker(nixl)
    pulling(worker, "turn-2", [11, 12])

    worker._complete_sync_load("turn-2")

    assert nixl.released == [11, 12]
    assert worker._recving_transfers == {} and worker._recving_metadata == {}  # never reported
    assert not worker._recv_failures and "turn-2" not in worker._pull_deadlines
    assert invalid_blocks(worker) == set()


def test_a_synchronous_load_still_reading_at_its_timeout_fails_its_blocks_and_its_peer() -> None:
    nixl = FakeNixl(states={11: "DONE", 12: "PROC"})
    worker = bare_worker(nixl)
    pulling(worker, "turn-2", [11, 12])
    pulling(worker, "sibling", [21])

    started = time.monotonic()
    worker._complete_sync_load("turn-2")

    assert 0.05 <= time.monotonic() - started < 1.0
    assert invalid_blocks(worker) == {3, 4}  # vLLM computes them in this request
    assert 12 in nixl.released
    assert "turn-2" not in worker._recving_metadata and "turn-2" not in worker._recv_failures
    assert "decode" in worker._quarantine
    assert worker._recv_failures == {"sibling"}  # the peer's other pulls recompute too


@pytest.mark.parametrize("state", ["ERR", "DISCONNECT"])
def test_a_synchronous_load_whose_read_failed_fails_its_blocks_at_once(state: str) -> None:
    nixl = FakeNixl(states={11: state})
    worker = bare_worker(nixl)
    pulling(worker, "turn-2", [11])

    started = time.monotonic()
    worker._complete_sync_load("turn-2")

    assert time.monotonic() - started < 0.05  # no wait for the timeout
    assert invalid_blocks(worker) == {3, 4}
    assert worker._recving_metadata == {} and worker._recv_failures == set()
    assert "decode" in worker._quarantine


def test_a_synchronous_load_waits_for_a_handshake_that_completes_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def post(self: AgentKVWorker, req_id: str, meta: object) -> None:
        self._recving_transfers[req_id] = [31]

    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", post)
    worker = bare_worker(FakeNixl(states={31: "DONE"}))
    meta = pulling(worker, "turn-2", None)
    worker._ready_requests.put(("turn-2", meta))

    worker._complete_sync_load("turn-2")

    assert invalid_blocks(worker) == set() and worker._recving_metadata == {}


def test_a_synchronous_load_whose_handshake_does_not_end_fails_and_posts_nothing_later() -> None:
    worker = bare_worker(FakeNixl())
    pulling(worker, "turn-2", None)

    worker._complete_sync_load("turn-2")

    assert invalid_blocks(worker) == {3, 4}
    assert "turn-2" in worker._abandoned  # a late handshake posts no read into its blocks
    assert "decode" not in worker._quarantine  # nothing is known against the peer


def test_a_synchronous_load_whose_blocks_need_converting_is_computed_instead() -> None:
    worker = bare_worker(FakeNixl(states={11: "DONE"}))
    worker.transfer_topo = FakeTopology(remote_block_size=8, local_block_size=16)
    pulling(worker, "turn-2", [11])

    worker._complete_sync_load("turn-2")

    assert invalid_blocks(worker) == {3, 4}
    assert worker._recving_metadata == {}


def test_start_load_kv_completes_only_the_loads_marked_synchronous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(NixlPullConnectorWorker, "start_load_kv", mock.Mock())
    worker = bare_worker(FakeNixl(states={11: "DONE", 12: "DONE"}))
    pulling(worker, "sync", [11])
    pulling(worker, "async", [12])
    metadata = SimpleNamespace(reqs_to_recv={}, heartbeat_by_engine={})
    mark_sync_loads(metadata, {"sync"})

    worker.start_load_kv(metadata)

    assert worker._recving_transfers == {"async": [12]}  # left to upstream's poll
