"""A turn's tokens (reused, computed) and time, from what its engines answered.

The counts go to the client's headers and the metrics, and teach the policy its rates: P steps
(computed and pulled tokens against time), local turns (new tokens against the holder's time to
first byte) and the handoff (D's time to first byte after a P step).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.orchestrator.plan import Plan
from agentkv_server.router.policy import PrefillSample, ReusePolicy
from agentkv_server.router.sessions import Holding
from agentkv_server.router.turn import Turn

__all__ = ["account_local", "account_prefill", "log_breakdown", "record_turn"]

logger = logging.getLogger(__name__)


def account_prefill(
    turn: Turn,
    policy: ReusePolicy,
    answer: dict[str, Any],
    pulled_from: Holding | None,
    seconds: float,
    holder_busy: bool = False,
) -> bool:
    """Reused and computed tokens from P's usage, and a rate sample for the policy (``seconds``:
    the step's service, policy.PrefillSample). False when P was to pull ``pulled_from`` and
    recomputed instead. ``holder_busy``: the holder had requests in flight when the turn was
    planned.

    Reused tokens are P's ``prompt_tokens_details.cached_tokens`` when the engine reports
    them; otherwise the holding's ``remote_num_tokens`` clipped to the prompt. A reported
    count under half of what was planned means the pull failed and P recomputed.
    """
    usage = turn.wire.prompt_usage(answer)
    prompt_tokens, cached = usage.prompt_tokens, usage.cached_tokens
    pulled = pulled_from is not None
    if pulled_from is not None:
        planned = pulled_from.num_tokens
        if prompt_tokens is not None:
            planned = min(planned, prompt_tokens)
        if cached is None:
            turn.reused_tokens = planned
        elif cached * 2 < planned:
            pulled = False
        else:
            turn.reused_tokens = min(cached, planned)
    if prompt_tokens is not None:
        turn.prompt_tokens = prompt_tokens
        already = cached if cached is not None else turn.reused_tokens
        turn.computed_tokens = max(prompt_tokens - already, 0)
        sample = PrefillSample(turn.computed_tokens, turn.reused_tokens, seconds, holder_busy)
        policy.observe(sample)
    return pulled


def account_local(
    turn: Turn, plan: Plan, policy: ReusePolicy, answer: dict[str, Any] | None
) -> None:
    """Reused tokens of a local turn: the engine's cached count, else the holding's."""
    assert plan.holding is not None
    usage = turn.wire.prompt_usage(answer) if answer is not None else None
    prompt_tokens = usage.prompt_tokens if usage is not None else None
    cached = usage.cached_tokens if usage is not None else None
    prompt_tokens = prompt_tokens if prompt_tokens is not None else plan.prompt_tokens
    held = plan.holding.num_tokens
    if cached is not None:
        turn.reused_tokens = cached
    else:
        turn.reused_tokens = held if prompt_tokens is None else min(held, prompt_tokens)
    if prompt_tokens is not None:
        turn.computed_tokens = max(prompt_tokens - turn.reused_tokens, 0)
    if turn.request.stream:  # a non-streamed answer's time includes its whole decode
        busy = plan.holder_running > 0
        policy.observe_local(turn.computed_tokens, turn.phases["decode"], holder_busy=busy)


def record_turn(metrics: RouterMetrics, turn: Turn) -> None:
    metrics.record_turn(
        turn.path, time.monotonic() - turn.started, turn.reused_tokens, turn.computed_tokens
    )


def log_breakdown(turn: Turn) -> None:
    if not logger.isEnabledFor(logging.DEBUG):  # the breakdown is formatted before the call
        return
    logger.debug(
        "session %s turn %s: %s reused=%d computed=%d",
        turn.request.session_id,
        turn.path,
        turn.breakdown(),
        turn.reused_tokens,
        turn.computed_tokens,
    )
