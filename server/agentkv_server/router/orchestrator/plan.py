"""Where a turn's history KV comes from, decided once, before any engine step runs.

The session's holding is taken atomically (a concurrent turn of the same session gets none),
the holder counts the prompt's new tokens (tokens.py) and the policy chooses ``local``, pull or
recompute. Local turns and pulls are planned only on a holder that is not known lost since the
holding was made and that answers now (watchdog.py): a pull from a holder that cannot answer
would leave P waiting on it, so the turn falls back to recomputing at once.

A holding released to make room on an engine with a host tier (capacity.py) left its KV there:
the turn may continue on that engine, which loads the history back, or recompute; never pull
it (NIXL reads the engine's KV cache, not the tier).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.orchestrator.services import Services
from agentkv_server.router.placement import Engine
from agentkv_server.router.policy import TurnLoad
from agentkv_server.router.sessions import Holding
from agentkv_server.router.tokens import count_prompt_tokens
from agentkv_server.router.turn import KVPath
from agentkv_server.router.upstream import EngineFailure

__all__ = ["Plan", "Planner"]

logger = logging.getLogger(__name__)


class Plan(NamedTuple):
    """What a turn sets out to do; what happens instead is the turn's to record.

    Immutable, and one per turn: a named tuple costs a third of a frozen dataclass."""

    retention_s: float
    """Seconds the decode engine is asked to keep this turn's KV (the policy's, for a session;
    0 without one). A step asks for none while the store is out."""
    path: KVPath = KVPath.RECOMPUTE
    holding: Holding | None = None
    """The session's holding, taken for this turn: pulled, continued, or released."""
    holder: Engine | None = None
    """The holding's decode engine, when the plan continues on it (``local``) or pulls from it."""
    prompt_tokens: int | None = None
    """The prompt's tokens as the holder counted them; None when it was not asked."""
    holder_running: int = 0
    """Requests the router had in flight on the holder when the turn was planned: the
    sequences a local prefill slows, and whose steps a pull's read waits for."""
    added_itl_s: float | None = None
    """For ``local``: the delay predicted per decode step of the holder's running sequences."""
    reason: str | None = None
    """Why this path: the policy's reason (``host_tier`` for a local turn that loads its
    history from the holder's host tier); ``released_pressure``, ``released_live_turn`` or
    ``released_abandoned`` (the session's holding went to make room), ``none_held`` (it had
    none, or it expired) or ``holder_silent`` (its holder did not answer); None without a
    session."""
    from_host_tier: bool = False
    """``holding`` was released to make room: its KV is in the holder's host tier, and its
    blocks are no longer the holder's to free."""

    @property
    def had_holding(self) -> bool:
        """Whether the session had a holding for this turn: taken, or released to make room
        (the session has run before)."""
        return self.holding is not None or (self.reason or "").startswith(RELEASED)

    @property
    def occupies_holder(self) -> bool:
        """Whether the holding still occupies its holder's KV cache (a release frees it)."""
        return self.holding is not None and not self.from_host_tier

    @property
    def holder_url(self) -> str | None:
        """The decode engine the turn prefers (its prefix cache holds the history), if any."""
        return self.holding.decode_url if self.holding is not None else None


NONE_HELD = "none_held"
RELEASED = "released_"  # + why the session's holding went (capacity.ReleaseReason)
HOLDER_SILENT = "holder_silent"

_NO_SESSION = Plan(0.0)
"""Every turn without a session id: nothing to take, nothing to keep."""


class Planner:
    """Turns a request into its :class:`Plan`."""

    __slots__ = ("_services",)

    def __init__(self, services: Services) -> None:
        self._services = services

    async def plan(self, request: ClientRequest) -> Plan:
        services = self._services
        key = request.session_key
        if key is None:
            return _NO_SESSION
        retention_s = services.policy.retention_s(request.hints)
        holding, released, in_host_tier = await services.keeper.take(key)
        if holding is None:
            lost = NONE_HELD if released is None else f"{RELEASED}{released}"
            if in_host_tier is not None:
                return await self._plan_from_host_tier(request, retention_s, in_host_tier, lost)
            return Plan(retention_s, reason=lost)
        holder = self._holder_of(holding)
        prompt_tokens = await self._count_prompt(request, holder) if holder is not None else None
        running = holder.inflight if holder is not None else 0
        load = None
        if holder is not None and prompt_tokens is not None:
            load = self._load(holding, holder, prompt_tokens)
        decision = services.policy.decide(holding, time.time(), load)
        services.metrics.record_decision(decision.path, decision.reason, decision.added_itl_s)
        logger.debug(
            "session %s: %s (%s) held=%d new=%s holder_running=%s",
            key,
            decision.path,
            decision.reason,
            holding.num_tokens,
            None if load is None else load.new_tokens,
            None if load is None else load.holder_running,
        )
        if decision.path is KVPath.RECOMPUTE:
            return Plan(
                retention_s, KVPath.RECOMPUTE, holding, prompt_tokens=prompt_tokens,
                reason=decision.reason,
            )  # fmt: skip
        if holder is None or not await self._answers(holder):
            # The holder cannot answer: a pull would wait on it.
            return Plan(
                retention_s, KVPath.FALLBACK, holding, prompt_tokens=prompt_tokens,
                reason=HOLDER_SILENT,
            )  # fmt: skip
        return Plan(
            retention_s, decision.path, holding, holder, prompt_tokens, running,
            decision.added_itl_s, decision.reason,
        )  # fmt: skip

    async def _plan_from_host_tier(
        self, request: ClientRequest, retention_s: float, holding: Holding, lost: str
    ) -> Plan:
        """Continue on the engine whose host tier has the released holding's KV, when the
        policy finds that faster than recomputing on P and the engine answers. Else recompute:
        for the reason the holding went (``lost``) when the engine is gone or cannot count the
        prompt, for the policy's reason when it refused, ``holder_silent`` when it is silent."""
        services = self._services
        holder = self._holder_of(holding)
        prompt_tokens = await self._count_prompt(request, holder) if holder is not None else None
        if holder is None or prompt_tokens is None:
            return self._tier_unused(retention_s, holding, lost)
        decision = services.policy.decide_from_host_tier(
            holding.num_tokens, self._load(holding, holder, prompt_tokens)
        )
        services.metrics.record_decision(decision.path, decision.reason, decision.added_itl_s)
        if decision.path is not KVPath.LOCAL:
            return self._tier_unused(retention_s, holding, decision.reason)
        if not await self._answers(holder):
            return self._tier_unused(retention_s, holding, HOLDER_SILENT)
        return Plan(
            retention_s, KVPath.LOCAL, holding, holder, prompt_tokens, holder.inflight,
            decision.added_itl_s, decision.reason, from_host_tier=True,
        )  # fmt: skip

    def _tier_unused(self, retention_s: float, holding: Holding, reason: str) -> Plan:
        """A recompute after all: the reuse the host tier kept is lost to pressure (the ledger
        counts the holdings released without a tier to keep them)."""
        self._services.metrics.record_reuse_lost_to_pressure(holding.num_tokens)
        return Plan(retention_s, reason=reason)

    def _holder_of(self, holding: Holding) -> Engine | None:
        """The holding's decode engine, unless it is unknown or lost since the holding was
        made (its KV, and its host tier's, are gone)."""
        holder = self._services.decode.get(holding.decode_url)
        if holder is not None and not holder.may_serve_holding(holding.issued_at):
            return None
        return holder

    def _load(self, holding: Holding, holder: Engine, prompt_tokens: int) -> TurnLoad:
        """What the local path's choice needs beyond the holding (policy.TurnLoad)."""
        services = self._services
        new_tokens = max(prompt_tokens - holding.num_tokens, 0)
        # A session's turn with a holding is a follow-up: only other follow-ups go before it
        # on P (queue.py).
        queues = [e.queue for e in services.prefill.engines if e.healthy]
        queue = min(queues, key=lambda q: q.follow_up_backlog_s(), default=None)
        context = prompt_tokens + holder.steps.prefilling_tokens
        added_s = services.decode.measured(holder, lambda steps: steps.added_s(context))
        read_delay_s = services.decode.measured(
            holder, lambda steps: steps.read_delay_s(holding.num_tokens)
        )
        steps = holder.steps
        return TurnLoad(
            new_tokens, holder.inflight, added_s,
            queue.follow_up_backlog_s() if queue is not None else 0.0, read_delay_s,
            steps.slowed_gaps, steps.window_gaps,
            queue.turns_sharing if queue is not None else 0,
        )  # fmt: skip

    async def _count_prompt(self, request: ClientRequest, holder: Engine) -> int | None:
        """The prompt's tokens on the holder, for the local path's choice; None when the policy
        does not consider that path or the holder cannot count them."""
        services = self._services
        if not services.policy.considers_local:
            return None
        try:
            prompt_tokens = await count_prompt_tokens(
                services.http, holder, request, request.headers, services.timeouts.tokenize
            )
        except EngineFailure as failure:
            logger.debug("%s: planning without the local path", failure)
            return None
        holder.mark_answered()
        return prompt_tokens

    async def _answers(self, holder: Engine) -> bool:
        problem = await self._services.watchdog.unanswered(holder)
        if problem is None:
            return True
        logger.warning("holder %s does not answer (%s): recomputing", holder.url, problem)
        self._services.metrics.record_engine_error(holder.role, problem)
        return False
