"""A turn's flow: plan, then the local step or the P and D steps, then the session's end.

Each step runs through the attempt loop (attempts.py). The turn's path is the plan's until a
planned reuse does not happen; then it is ``fallback``, set here and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from starlette.responses import Response

from agentkv_server.router.admission import Overloaded, priority_of
from agentkv_server.router.errors import RouterError
from agentkv_server.router.holdings import HoldingKeeper
from agentkv_server.router.http_client import HTTPClient
from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.orchestrator.attempts import Refused, attempt
from agentkv_server.router.orchestrator.plan import Plan, Planner
from agentkv_server.router.orchestrator.services import Services
from agentkv_server.router.orchestrator.steps import (
    DecodeAttempt,
    PrefillAttempt,
    Prefilled,
    prefill_tokens,
)
from agentkv_server.router.placement import Engine, EnginePool
from agentkv_server.router.policy import ReusePolicy
from agentkv_server.router.turn import KVPath, Turn
from agentkv_server.router.upstream import EngineFailure
from agentkv_server.settings import Settings

__all__ = ["Orchestrator"]

logger = logging.getLogger(__name__)


class Orchestrator:
    """Serves turns; one per app, shared by all requests."""

    __slots__ = ("_planner", "_services", "pairs")

    def __init__(
        self,
        settings: Settings,
        http: HTTPClient,
        prefill: EnginePool,
        decode: EnginePool,
        keeper: HoldingKeeper,
        policy: ReusePolicy,
        metrics: RouterMetrics,
    ) -> None:
        self._services = Services(settings, http, prefill, decode, keeper, policy, metrics)
        self._planner = Planner(self._services)
        # Each prefill/decode pair's KV transfer health; the app records holding reports here.
        self.pairs = self._services.pairs

    def record_report(self, ticket: str, params: dict[str, Any]) -> None:
        """What a decode engine's holding report says besides the holding (which the keeper
        records): how its read of P's KV went, and its wait for blocks."""
        self.pairs.record_ticket(ticket, params)
        self._services.block_waits.record("decode", params)

    async def serve(self, request: ClientRequest, started: float) -> Response:
        services = self._services
        plan = await self._planner.plan(request)
        turn = Turn(
            request, started, path=plan.path, added_itl_s=plan.added_itl_s, reason=plan.reason,
            deadline=started + services.settings.timeouts.first_token_s,
            priority=priority_of(request, plan.had_holding),
        )  # fmt: skip
        turn.phases["plan"] = time.monotonic() - started
        if plan.path is not KVPath.LOCAL:
            await self._admit(turn, plan)
        avoid: list[Engine] = []
        if plan.path is KVPath.LOCAL:
            response = await self._local_step(turn, plan)
            if response is not None:
                return await self._after(turn, response)
            avoid = [plan.holder] if plan.holder is not None else []
        began = time.monotonic()
        prefill = PrefillAttempt(self._services, turn, plan)
        keeper = self._services.keeper
        to_pull = plan.holding if plan.path is KVPath.PULL else None
        if to_pull is not None:  # its blocks stay on the holder until P has read them
            keeper.pull_started(to_pull)
        elif plan.occupies_holder and plan.path is not KVPath.LOCAL:
            # Nothing will read it: free it now, not after P's queue (a failed local step
            # released what it continued).
            keeper.release_soon([plan.holding])
        try:
            with _read_window(plan):
                prefilled = await attempt(prefill)
            if _fell_back(plan, prefilled):
                turn.fall_back()
            if isinstance(prefilled, Refused):  # only a cold step's refusal is passed back
                return _passthrough(turn, prefilled.failure)
        finally:
            if to_pull is not None:
                if not (turn.pulls and prefill.pulling):  # not pulled: it still occupies D
                    keeper.release_soon([to_pull])
                keeper.pull_ended(to_pull)
            turn.phases["prefill"] = time.monotonic() - began - turn.phases.get("queue", 0.0)
        # Without a P step (no P engine left) D computes the prompt itself.
        response = await self._decode_step(turn, plan, prefilled, avoid)
        return await self._after(turn, response)

    async def _admit(self, turn: Turn, plan: Plan) -> None:
        """Refuse the turn now if it would wait too long for a prefill engine (Overloaded),
        giving its session's holding back for the client's next try."""
        services = self._services
        tokens = prefill_tokens(services, turn, plan, plan.path is KVPath.PULL)
        try:
            services.admission.admit(turn.request, turn.priority, tokens, turn.headers())
        except Overloaded:
            if plan.occupies_holder:
                assert plan.holding is not None
                await services.keeper.give_back(plan.holding)
            raise

    async def _local_step(self, turn: Turn, plan: Plan) -> Response | None:
        """The turn on its holder without a P step; None if the holder failed before its first
        byte (the turn then recomputes elsewhere)."""
        assert plan.holder is not None and plan.holding is not None
        step = DecodeAttempt(self._services, turn, plan, holder=plan.holder)
        served = await attempt(step, tries=1)
        if served is None:
            failure = turn.failures[-1]
            logger.warning(
                "local turn on %s failed (%s): recomputing", plan.holder.url, failure.kind
            )
            return None
        return _answer(turn, served)  # the step released the holding it continues

    async def _decode_step(
        self, turn: Turn, plan: Plan, prefilled: Prefilled | None, avoid: list[Engine]
    ) -> Response:
        step = DecodeAttempt(self._services, turn, plan, prefilled)
        served = await attempt(step, tries=self._services.settings.decode_attempts, excluded=avoid)
        if served is None:
            raise _unservable(turn)
        return _answer(turn, served)

    async def _after(self, turn: Turn, response: Response) -> Response:
        request = turn.request
        if request.hints.session_end and request.session_key is not None:
            await self._services.keeper.end_soon(request.session_key)
        return response


def _read_window(plan: Plan) -> contextlib.AbstractContextManager[None]:
    """While a P step pulls from the holder, the holder's streams measure what the read costs
    them (placement.StepTimes.pull_read)."""
    if plan.path is not KVPath.PULL or plan.holder is None or plan.holding is None:
        return contextlib.nullcontext()
    return plan.holder.steps.pull_read(plan.holding.num_tokens)


def _fell_back(plan: Plan, prefilled: Prefilled | Refused | None) -> bool:
    """Whether a planned reuse did not happen: a local turn came to the P step after all, or
    no P step pulled the holding."""
    if plan.path is KVPath.LOCAL:
        return True
    pulled = isinstance(prefilled, Prefilled) and prefilled.pulled
    return plan.path is KVPath.PULL and not pulled


def _answer(turn: Turn, served: Response | Refused) -> Response:
    return _passthrough(turn, served.failure) if isinstance(served, Refused) else served


def _passthrough(turn: Turn, refused: EngineFailure) -> Response:
    """An engine's own 4xx, handed back as it wrote it."""
    return Response(
        refused.body,
        status_code=refused.status or 400,
        media_type=refused.content_type,
        headers=turn.headers(),
    )


def _unservable(turn: Turn) -> RouterError:
    if not turn.failures:
        return RouterError(
            503,
            "No healthy decode engine is available.",
            type="server_error",
            code="no_engine_available",
        )
    # The detail (engine URLs, the engine's own text) is the operator's: the log and the
    # engine errors' metric. The tenant learns which step failed and that a retry may serve it.
    failure = turn.failures[-1]
    logger.warning(
        "turn failed: no engine could serve its %s step after %d failures; the last: %s",
        failure.engine.role,
        len(turn.failures),
        failure,
    )
    return RouterError(
        502,
        f"The turn's {failure.engine.role} step failed on every engine tried. Nothing of it "
        "was answered; a retry may be served.",
        type="server_error",
        code="engine_failure",
        headers={"x-should-retry": "true"},
    )
