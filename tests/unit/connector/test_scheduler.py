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

pytest.importorskip("vllm", reason="the scheduler half subclasses vLLM's NIXL scheduler")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler
from vllm.v1.request import RequestStatus

from agentkv_server.connector.prefix import PrefixFingerprint
from agentkv_server.connector.scheduler import AgentKVScheduler

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
    scheduler._reporter = None
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
