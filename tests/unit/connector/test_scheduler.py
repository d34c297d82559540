"""P's scheduler half after a failed pull: the request is computed, never parked again.

The scheduler half is built bare (no engine) with the state upstream's planning touches; the
calls are the ones vLLM's scheduler makes for a request that pulls a holding, whose load then
fails and which the ``recompute`` policy schedules afresh. The reproduction on real engines is
``tests/engine/test_faults.py::test_decode_engine_killed_between_turns``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the scheduler half subclasses vLLM's NIXL scheduler")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler

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
    scheduler._loading = set()
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
