"""P's scheduler half after a failed pull: the request is computed, never parked again.

The scheduler half is built bare (no engine) with the state upstream's planning touches; the
calls are the ones vLLM's scheduler makes for a request that pulls a holding, whose load then
fails and which the ``recompute`` policy schedules afresh. The reproduction on real engines is
``tests/engine/test_faults.py::test_decode_engine_killed_between_turns``.
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler
from vllm.v1.request import RequestStatus

from agentkv_server.connector.blockwaits import BlockWaits
from agentkv_server.connector.prefix import PrefixFingerprint
from agentkv_server.connector.scheduler import AgentKVScheduler
from agentkv_server.connector.settings import ConnectorSettings
from agentkv_server.connector.syncload import sync_loads_of

BLOCK = 16
HELD = list(range(100, 100 + 4 * BLOCK))  # four whole blocks on the holder


def bare_scheduler() -> AgentKVScheduler:
    scheduler = object.__new__(AgentKVScheduler)
    scheduler.kv_recompute_threshold = 0
    scheduler._is_hma_required = False
    scheduler.use_host_buffer = False
    scheduler.is_bidirectional_kv_xfer_enabled = True
    scheduler.kv_cache_config = SimpleNamespace(select_transfer_block_ids=lambda ids: ids)
    scheduler._reqs_in_batch = set()
    scheduler._reqs_need_recv = {}
    scheduler._unfinished = {}
    scheduler._loaded_at = {}
    scheduler._loads = {}
    scheduler._block_waits = BlockWaits()
    scheduler._reporter = None
    scheduler._settings = ConnectorSettings()
    scheduler._sync_peers = set()
    scheduler._sync_asked = {}
    scheduler.block_size = BLOCK
    return scheduler


def pulling_request() -> SimpleNamespace:
    """A prefill request whose prompt extends the held tokens, with the holder's params."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "decode",
        "remote_request_id": "held",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_num_tokens": len(HELD),
        **PrefixFingerprint.of(HELD, BLOCK).to_params(),
    }
    prompt = [*HELD, 7, 8, 9]
    return SimpleNamespace(
        request_id="turn-2",
        kv_transfer_params=params,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
    )


def allocated(block_ids: list[int]) -> SimpleNamespace:
    """The blocks vLLM's cache manager hands a request (none of them cached yet)."""
    blocks = [SimpleNamespace(block_hash=None, is_null=False) for _ in block_ids]
    return SimpleNamespace(
        blocks=(blocks,), get_unhashed_block_ids_all_groups=lambda: (list(block_ids),)
    )


def test_a_request_asking_again_after_its_pull_is_computed_not_parked() -> None:
    scheduler = bare_scheduler()
    request = pulling_request()

    first = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, allocated([10, 11, 12, 13, 14]), first[0])
    # The load fails; the recompute policy resets the request, and the scheduler asks again.
    again = scheduler.get_num_new_matched_tokens(request, 0)

    assert first == (len(HELD), True)
    assert list(scheduler._reqs_need_recv) == ["turn-2"]  # the one load that is planned
    assert again == (0, False)  # its prefix is computed
    # Upstream would answer with a second asynchronous load but plan none: the request
    # would wait in WAITING_FOR_REMOTE_KVS for ever. If this changes, drop the override.
    assert NixlPullConnectorScheduler.get_num_new_matched_tokens(scheduler, request, 0)[1]


def test_a_request_that_was_never_planned_may_ask_more_than_once() -> None:
    # The scheduler asks before it allocates; a step without room asks again next step.
    scheduler = bare_scheduler()
    request = pulling_request()

    asks = [scheduler.get_num_new_matched_tokens(request, 0) for _ in range(2)]

    assert asks == [(len(HELD), True)] * 2


def no_step() -> SimpleNamespace:
    return SimpleNamespace(total_num_scheduled_tokens=0)


def plain_request() -> SimpleNamespace:
    return SimpleNamespace(request_id="turn-1", kv_transfer_params=None, status=None)


def test_a_request_that_waits_with_nothing_scheduled_keeps_the_engine_stepping() -> None:
    # Its load finished (or it is not admitted yet): only another step can schedule it, and a
    # paced wait would end only on a new request (docs/connector.md, "Idle engines").
    scheduler = bare_scheduler()
    request = plain_request()
    assert not scheduler._has_work(no_step())

    scheduler.on_new_request(request)

    assert scheduler._has_work(no_step())


def test_an_engine_whose_requests_all_finished_is_paced() -> None:
    scheduler = bare_scheduler()
    request = plain_request()
    scheduler.on_new_request(request)
    request.status = RequestStatus.FINISHED_STOPPED

    scheduler.request_finished(request, ([],))

    assert not scheduler._has_work(no_step())
    assert scheduler._has_work(SimpleNamespace(total_num_scheduled_tokens=1))


def test_a_loaded_request_left_unscheduled_is_reported_once(monkeypatch, caplog) -> None:
    scheduler = bare_scheduler()
    request = plain_request()
    scheduler.on_new_request(request)
    request.num_computed_tokens, request.num_tokens = 64, 67
    clock = itertools.chain([100.0, 101.0, 103.0], itertools.repeat(104.0)).__next__
    monkeypatch.setattr("agentkv_server.connector.scheduler.time.monotonic", clock)
    scheduler._loaded_at["turn-1"] = clock()  # as update_connector_output records a load
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "propagate", True)

    with caplog.at_level(logging.WARNING, logger="vllm"):
        for _ in range(3):  # 1 s (quiet), 3 s (reported), then never again
            scheduler._note_loaded_requests_left_waiting(SimpleNamespace(num_scheduled_tokens={}))

    assert [r.getMessage() for r in caplog.records] == [
        (
            "Request turn-1: its KV arrived 3.0 s ago and it is not scheduled yet "
            "(status None, 64 of 67 tokens computed, 1 unfinished requests)"
        )
    ]


def test_a_loaded_request_that_runs_is_not_reported() -> None:
    scheduler = bare_scheduler()
    request = plain_request()
    scheduler.on_new_request(request)
    scheduler._loaded_at["turn-1"] = 0.0  # long ago

    scheduler._note_loaded_requests_left_waiting(
        SimpleNamespace(num_scheduled_tokens={"turn-1": 3})
    )

    assert scheduler._loaded_at == {}


# -- the load outcome each finished request returns (docs/router.md, "Pair health") ------------


def finishing(scheduler: AgentKVScheduler) -> AgentKVScheduler:
    """What upstream's ``update_connector_output`` and ``request_finished`` touch."""
    scheduler._heartbeat_req_engine = {}
    scheduler._heartbeat_by_engine = {}
    scheduler._retained = set()
    scheduler._reqs_not_processed = set()
    scheduler._reqs_need_save = {}
    scheduler._reqs_need_send = {}
    scheduler.engine_id = "this-engine"
    scheduler.side_channel_host, scheduler.side_channel_port = "127.0.0.1", 5601
    scheduler.transfer_tp_size = 1
    parallel = SimpleNamespace(decode_context_parallel_size=1, pipeline_parallel_size=1)
    scheduler.vllm_config = SimpleNamespace(parallel_config=parallel)
    return scheduler


def decoding_request() -> SimpleNamespace:
    """A decode request that reads its prompt's KV from prefill engine ``prefill``."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill",
        "remote_request_id": "p-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_num_tokens": len(HELD),
    }
    return SimpleNamespace(
        request_id="turn-1",
        kv_transfer_params=params,
        prompt_token_ids=list(HELD),
        num_prompt_tokens=len(HELD),
        status=None,
    )


def transfer_output(finished: set[str], failed: set[str]) -> SimpleNamespace:
    """A step's KVConnectorOutput as vLLM's aggregator builds it (failed loads finish too)."""
    return SimpleNamespace(
        finished_sending=None, finished_recving=finished | failed, failed_recving=failed
    )


def finish(scheduler: AgentKVScheduler, request: SimpleNamespace) -> dict[str, Any] | None:
    request.status = RequestStatus.FINISHED_STOPPED
    return scheduler.request_finished(request, ([],))[1]


@pytest.mark.parametrize("failed", [True, False], ids=["failed", "ok"])
def test_a_decode_request_returns_how_its_load_from_prefill_ended(failed) -> None:
    scheduler = finishing(bare_scheduler())
    request = decoding_request()
    scheduler.on_new_request(request)
    scheduler.update_state_after_alloc(request, allocated([10, 11, 12, 13]), len(HELD))

    scheduler.update_connector_output(
        transfer_output(set(), {"turn-1"}) if failed else transfer_output({"turn-1"}, set())
    )
    params = finish(scheduler, request)

    assert params is not None
    assert params["agentkv_kv_load"] == ("failed" if failed else "ok")
    assert params["agentkv_kv_load_from"] == "prefill"
    assert "agentkv_kv_load_sync" not in params  # a first load from a peer waits for its step
    assert params["remote_engine_id"] == "this-engine"  # upstream's own fields stay as they were
    assert scheduler._loads == {}


def test_a_pull_that_failed_and_was_computed_returns_failed() -> None:
    scheduler = finishing(bare_scheduler())
    scheduler._kv_lease_duration = 30
    request = pulling_request()
    first = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, allocated([10, 11, 12, 13, 14]), first[0])
    scheduler.update_connector_output(transfer_output(set(), {"turn-2"}))
    # Recomputed: asked again, it loads nothing this time.
    again = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, allocated([20, 21, 22, 23, 24]), again[0])

    params = finish(scheduler, request)

    assert params is not None
    assert (params["agentkv_kv_load"], params["agentkv_kv_load_from"]) == ("failed", "decode")


def test_a_request_that_loaded_nothing_remote_returns_no_outcome() -> None:
    scheduler = finishing(bare_scheduler())
    request = decoding_request()
    request.kv_transfer_params.update(do_remote_prefill=False, remote_block_ids=None)
    scheduler.on_new_request(request)
    scheduler.update_state_after_alloc(request, allocated([10, 11, 12, 13]), 0)
    scheduler.update_connector_output(transfer_output(set(), set()))

    params = finish(scheduler, request)

    assert params is not None and "agentkv_kv_load" not in params


def test_a_load_still_running_when_its_request_ends_returns_no_outcome() -> None:
    # Aborted while waiting for its KV: nothing is known of the load, and nothing is kept.
    scheduler = finishing(bare_scheduler())
    request = decoding_request()
    scheduler.update_state_after_alloc(request, allocated([10, 11, 12, 13]), len(HELD))

    params = finish(scheduler, request)

    assert params is not None and "agentkv_kv_load" not in params
    assert scheduler._loads == {}


# -- the wait for blocks each finished request returns (connector/blockwaits.py) ---------------


class Steps:
    """A scheduler's steps on a clock the test moves: ``step(seconds)`` ends the scheduling of
    one step (vLLM builds the connector's metadata right after it) and runs it for ``seconds``."""

    def __init__(self, scheduler: AgentKVScheduler, *, retaining: bool) -> None:
        self.now = 0.0
        self.scheduler = scheduler
        scheduler._block_waits = BlockWaits(clock=lambda: self.now)
        scheduler._holdings_in_the_way = lambda: retaining  # type: ignore[method-assign]
        scheduler._idle = SimpleNamespace(step=lambda busy: 0.0)
        scheduler._reqs_need_recv = {}
        scheduler._reqs_need_send = {}
        scheduler._reqs_in_batch = set()
        scheduler._reqs_not_processed = set()

    def step(self, seconds: float) -> None:
        self.scheduler._block_waits.step(self.scheduler._holdings_in_the_way)
        self.now += seconds


def local_request(req_id: str = "turn-1") -> SimpleNamespace:
    """A decode request computed here (nothing to load), as the local path sends."""
    request = decoding_request()
    request.request_id = req_id
    request.kv_transfer_params.update(do_remote_prefill=False, remote_block_ids=None)
    return request


def test_a_request_short_of_blocks_returns_its_wait_beside_retained_blocks() -> None:
    scheduler = finishing(bare_scheduler())
    steps = Steps(scheduler, retaining=True)
    first, behind = local_request(), local_request("turn-2")
    for request in (first, behind):
        scheduler.on_new_request(request)
    for _ in range(3):  # three steps with no blocks for the first, the other queued behind it
        scheduler.get_num_new_matched_tokens(first, 0)
        steps.step(0.5)
    scheduler.get_num_new_matched_tokens(first, 0)
    scheduler.update_state_after_alloc(first, allocated([10, 11, 12, 13]), 0)
    steps.step(0.5)
    scheduler.get_num_new_matched_tokens(behind, 0)
    scheduler.update_state_after_alloc(behind, allocated([14, 15, 16, 17]), 0)
    steps.step(0.5)

    params, queued = finish(scheduler, first), finish(scheduler, behind)

    assert params is not None and queued is not None
    assert params["agentkv_waited_for_blocks_seconds"] == 1.5
    assert params["agentkv_waited_beside_retained_seconds"] == 1.5
    # Behind it, the same: the step that admitted the first was not short of blocks (the one
    # after was the second's turn in the queue, not a wait for blocks).
    assert queued["agentkv_waited_for_blocks_seconds"] == 1.5


def finished_after(short_steps: int, step_s: float, *, retaining: bool) -> dict[str, Any] | None:
    """One request's returned params after ``short_steps`` steps without blocks for it, then
    its admission and one more step, each ``step_s`` long."""
    scheduler = finishing(bare_scheduler())
    steps = Steps(scheduler, retaining=retaining)
    request = local_request()
    scheduler.on_new_request(request)
    for _ in range(short_steps):
        scheduler.get_num_new_matched_tokens(request, 0)
        steps.step(step_s)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, allocated([10, 11, 12, 13]), 0)
    steps.step(step_s)
    steps.step(step_s)
    return finish(scheduler, request)


def test_a_wait_with_nothing_retained_is_not_blamed_on_holdings() -> None:
    params = finished_after(1, 0.25, retaining=False)  # no blocks: it waits one step

    assert params is not None
    assert params["agentkv_waited_for_blocks_seconds"] == 0.25
    assert params["agentkv_waited_beside_retained_seconds"] == 0.0


def test_a_request_admitted_at_once_returns_no_wait() -> None:
    params = finished_after(0, 2.0, retaining=True)  # long steps, but no wait for blocks

    assert params is not None and "agentkv_waited_for_blocks_seconds" not in params


def test_a_request_aborted_while_it_waits_is_forgotten() -> None:
    waits = BlockWaits(clock=iter([0.0, 1.0, 2.0, 3.0]).__next__)
    waits.arrived("turn-1")
    waits.asked("turn-1")
    waits.step(lambda: True)  # short: turn-1 waits
    waits.step(lambda: False)

    wait = waits.finished("turn-1")
    waits.step(lambda: False)

    assert wait is not None and (wait.seconds, wait.beside_retained_s) == (1.0, 1.0)
    assert waits.finished("turn-1") is None


def test_only_live_holdings_are_in_the_way(monkeypatch) -> None:
    now = 100.0
    monkeypatch.setattr("agentkv_server.connector.scheduler.time.perf_counter", lambda: now)
    scheduler = bare_scheduler()
    scheduler._retained = {"expired"}
    scheduler._deadlines = {"expired": 90.0}  # freed on the worker's next step
    assert not scheduler._holdings_in_the_way()

    scheduler._retained.add("held")
    scheduler._deadlines["held"] = 130.0
    assert scheduler._holdings_in_the_way()

    # Released a moment ago: the wait is now for those blocks, on their way out.
    scheduler._retained.add("released")
    scheduler._deadlines["released"] = 99.9
    assert not scheduler._holdings_in_the_way()
    now = 102.0  # a pending free this old is not counted on: the holding is in the way again
    assert scheduler._holdings_in_the_way()


# -- synchronous loads (connector/syncload.py) --------------------------------------------------


def decoding(scheduler: AgentKVScheduler) -> AgentKVScheduler:
    """What upstream's answer for a decode request's load touches."""
    scheduler._has_mamba = scheduler._bounded_replay = False
    scheduler.vllm_config.num_prefill_lookahead_tokens = 0
    return scheduler


def decode_turn(
    scheduler: AgentKVScheduler, req_id: str, local_tokens: int
) -> tuple[SimpleNamespace, tuple[int, bool]]:
    """A decode request that finds ``local_tokens`` of its prompt in D's cache, and the
    scheduler half's answer (tokens to load, whether asynchronously), its blocks allocated."""
    request = decoding_request()
    request.request_id = req_id
    scheduler.on_new_request(request)
    answer = scheduler.get_num_new_matched_tokens(request, local_tokens)
    scheduler.update_state_after_alloc(request, request_blocks(local_tokens, answer), answer[0])
    return request, answer


def request_blocks(local_tokens: int, answer: tuple[int, bool]) -> SimpleNamespace:
    """A decode request's blocks as vLLM's cache manager hands them over: the local hit's
    (ids from 1, cached), then new ones (ids from 40). vLLM caches a synchronous load's whole
    blocks at once; an asynchronous load's only once its read is done."""
    hit = local_tokens // BLOCK
    new = -(-(len(HELD) - local_tokens) // BLOCK)  # the prompt's last token included
    count, load_async = answer
    cached = hit if load_async else (local_tokens + count) // BLOCK
    ids = [*range(1, hit + 1), *range(40, 40 + new)]
    blocks = [
        SimpleNamespace(block_hash=i < cached or None, is_null=False) for i in range(len(ids))
    ]
    return SimpleNamespace(
        blocks=(blocks,),
        get_block_ids=lambda: (list(ids),),
        get_unhashed_block_ids_all_groups=lambda: ([ids[i] for i in range(cached, len(ids))],),
    )


def stepped(scheduler: AgentKVScheduler) -> frozenset[str]:
    """The loads the step's metadata marks synchronous (``build_connector_meta``'s part)."""
    meta = SimpleNamespace(reqs_to_recv=dict.fromkeys(scheduler._reqs_need_recv))
    scheduler._reqs_need_recv.clear()
    scheduler._dispatch_sync_loads(meta)
    return sync_loads_of(meta)


def test_a_decode_engine_loads_synchronously_from_a_prefill_engine_proven_by_a_load() -> None:
    scheduler = decoding(finishing(bare_scheduler()))

    first, answer = decode_turn(scheduler, "turn-1", local_tokens=0)
    assert answer == (len(HELD), True)  # nothing known of the peer: vLLM's asynchronous load
    assert stepped(scheduler) == frozenset()
    scheduler.update_connector_output(transfer_output({"turn-1"}, set()))
    finish(scheduler, first)

    second, answer = decode_turn(scheduler, "turn-2", local_tokens=3 * BLOCK)
    # The new block from a peer whose read worked, at once; its last token is computed.
    assert answer == (BLOCK - 1, False)
    assert stepped(scheduler) == {"turn-2"}
    params = finish(scheduler, second)

    assert params is not None
    assert (params["agentkv_kv_load"], params["agentkv_kv_load_from"]) == ("ok", "prefill")
    assert params["agentkv_kv_load_sync"] is True
    assert scheduler._heartbeat_req_engine == {}  # its read ended in its step: no heartbeat


def test_a_synchronous_load_reads_every_block_past_the_local_hit() -> None:
    # vLLM has cached blocks 40-42 as it allocated them: upstream's plan would read only 43.
    scheduler = decoding(finishing(bare_scheduler()))
    scheduler._sync_peers.add("prefill")

    _, answer = decode_turn(scheduler, "turn-2", local_tokens=0)

    assert answer == (len(HELD) - 1, False)
    _, read_into, local_blocks, awaiting = scheduler._reqs_need_recv["turn-2"]
    assert (read_into, local_blocks, awaiting) == (([40, 41, 42, 43],), (0,), True)
    assert scheduler._loads["turn-2"].sync_blocks == {40, 41, 42, 43}


def test_an_asynchronous_load_keeps_upstreams_plan() -> None:
    scheduler = decoding(finishing(bare_scheduler()))

    decode_turn(scheduler, "turn-1", local_tokens=2 * BLOCK)

    _, read_into, local_blocks, _ = scheduler._reqs_need_recv["turn-1"]
    assert (read_into, local_blocks) == (([40, 41],), (2,))


def test_a_long_read_stays_asynchronous() -> None:
    scheduler = decoding(finishing(bare_scheduler()))
    scheduler._settings = ConnectorSettings(sync_load_max_tokens=2 * BLOCK)
    scheduler._sync_peers.add("prefill")

    assert decode_turn(scheduler, "whole", local_tokens=0)[1] == (len(HELD), True)
    assert decode_turn(scheduler, "short", local_tokens=2 * BLOCK)[1] == (2 * BLOCK - 1, False)


def test_sync_loads_can_be_turned_off() -> None:
    scheduler = decoding(finishing(bare_scheduler()))
    scheduler._settings = ConnectorSettings(sync_load_max_tokens=0)
    scheduler._sync_peers.add("prefill")

    assert decode_turn(scheduler, "turn-2", local_tokens=3 * BLOCK)[1] == (BLOCK, True)


def test_a_synchronous_load_whose_blocks_failed_returns_failed_and_the_next_waits() -> None:
    scheduler = decoding(finishing(bare_scheduler()))
    scheduler._sync_peers.add("prefill")
    request, _ = decode_turn(scheduler, "turn-2", local_tokens=3 * BLOCK)
    assert stepped(scheduler) == {"turn-2"}

    # The worker reports the block it could not read; vLLM computes it in this request.
    scheduler.update_connector_output(
        SimpleNamespace(finished_sending=None, finished_recving=None, invalid_block_ids={40})
    )
    params = finish(scheduler, request)

    assert params is not None and params["agentkv_kv_load"] == "failed"
    assert params["agentkv_kv_load_sync"] is True
    assert decode_turn(scheduler, "turn-3", local_tokens=3 * BLOCK)[1] == (BLOCK, True)


def test_a_prefill_engine_pulls_holdings_asynchronously_from_a_proven_holder() -> None:
    scheduler = finishing(bare_scheduler())
    scheduler._sync_peers.add("decode")

    count, load_async = scheduler.get_num_new_matched_tokens(pulling_request(), 0)

    assert count == len(HELD) and load_async
