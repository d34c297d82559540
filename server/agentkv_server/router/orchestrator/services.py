"""What every step of a turn uses: the engine pools and calls, the keeper, the policy, metrics.

One per orchestrator, shared by all turns. Steps reach engines only through :meth:`Services.post`
and :meth:`Services.open_stream`, so that every call is counted in flight and runs under the
watchdog, and report each failed call to :meth:`Services.note_failure`, which blames the engine
as failures.py says.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentkv_server import wire
from agentkv_server.router.admission import Admission
from agentkv_server.router.blockwaits import BlockWaitTally
from agentkv_server.router.errors import TurnTimedOut
from agentkv_server.router.failures import LOST, SUSPECT
from agentkv_server.router.holdings import HoldingKeeper
from agentkv_server.router.http_client import HTTPClient, Timeout
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.pairs import PairHealth
from agentkv_server.router.placement import Engine, EnginePool
from agentkv_server.router.policy import ReusePolicy
from agentkv_server.router.queue import QueuedStep, StepQueue
from agentkv_server.router.sessions import Holding
from agentkv_server.router.tokens import PromptSizes
from agentkv_server.router.turn import Turn
from agentkv_server.router.upstream import (
    DecodeStream,
    EngineFailure,
    Silence,
    open_stream,
    post_json,
)
from agentkv_server.router.watchdog import Watchdog
from agentkv_server.settings import Settings, Timeouts

__all__ = ["DecodeRequest", "Services", "StepTimeouts"]

logger = logging.getLogger(__name__)

# A step's timeout that fires this close to its total bound is that bound (the clock's grain).
_DEADLINE_SLACK_S = 0.01


class DecodeRequest(NamedTuple):
    """A decode step as it goes to its engine."""

    body: dict[str, Any]
    ticket: str | None
    """The ticket of the holding it is to keep; None: it keeps none."""
    releases: list[Holding]
    """Holdings it releases to make its room (``agentkv_release``); if the step fails before
    its engine saw it, they are still held there: ``keeper.release_soon`` them."""


@dataclass(frozen=True)
class StepTimeouts:
    """Each kind of step's deadline, with the connect and pool waits all steps share."""

    decode: Timeout
    tokenize: Timeout
    connect_s: float
    pool_s: float

    @classmethod
    def of(cls, timeouts: Timeouts) -> StepTimeouts:
        def step(total_s: float) -> Timeout:
            return Timeout(total=total_s, connect=timeouts.connect_s, pool=timeouts.pool_s)

        return cls(
            decode=step(timeouts.decode_s),
            tokenize=step(timeouts.tokenize_s),
            connect_s=timeouts.connect_s,
            pool_s=timeouts.pool_s,
        )

    def within(self, turn: Turn) -> Timeout:
        """A step bounded by what is left of ``turn``'s deadline."""
        return Timeout(total=turn.remaining_s(), connect=self.connect_s, pool=self.pool_s)


@dataclass
class Services:
    """The router's collaborators as a turn's steps see them."""

    settings: Settings
    http: HTTPClient
    prefill: EnginePool
    decode: EnginePool
    keeper: HoldingKeeper
    policy: ReusePolicy
    metrics: RouterMetrics
    pairs: PairHealth = field(init=False)
    """Each prefill/decode pair's KV transfer health; the app records holding reports here."""
    block_waits: BlockWaitTally = field(init=False)
    admission: Admission = field(init=False)
    watchdog: Watchdog = field(init=False)
    timeouts: StepTimeouts = field(init=False)
    prompt_sizes: PromptSizes = field(init=False, default_factory=PromptSizes)
    """What a prompt no engine has counted yet is expected to come to."""

    def __post_init__(self) -> None:
        settings = self.settings
        self.pairs = PairHealth(
            settings.pairs,
            metrics=self.metrics,
            pairs=[(p.url, d.url) for p in self.prefill.engines for d in self.decode.engines],
        )
        self.block_waits = BlockWaitTally(self.metrics)
        self.admission = Admission(settings.admission, self.prefill, self.metrics)
        self.watchdog = Watchdog(self.http, settings.faults, settings.timeouts.health_s)
        self.timeouts = StepTimeouts.of(settings.timeouts)

    def kept_s(self, retention_s: float) -> float:
        """The retention to ask for now: none while the store is out, since nothing could
        record this turn's KV."""
        return retention_s if self.keeper.keeps_holdings else 0.0

    async def decode_request(
        self,
        turn: Turn,
        engine: Engine,
        body: dict[str, Any],
        prefill_params: dict[str, Any] | None,
        retention_s: float,
        *,
        tokens: int = 0,
        continued: Holding | None = None,
    ) -> DecodeRequest:
        """``body`` as a decode step on ``engine`` sends it: D's params are P's (None: D
        computes the prompt itself), the retention and the ticket. A step of ``tokens`` (0:
        unknown) and its answer that would not fit beside the engine's holdings releases the
        least valuable of them; with a ticket, its room stays reserved until its KV is
        recorded. A local step releases the holding it ``continued`` too: as it arrives, the
        step shares that holding's blocks (a prefix hit), and released any later, they stayed
        held while the step waited for room for its new part (on a full engine, three local
        turns each held their history and waited for the others', 9-11 s, until retention ran
        out)."""
        ticket = await self._issue_ticket(turn, engine, retention_s)
        output_limit = turn.wire.output_limit(body)
        releases = await self.keeper.make_room(
            engine.url, tokens, engine.inflight, ticket, output_limit
        )
        if continued is not None:
            releases.append(continued)
        hints = self.policy.sends_hints
        params = wire.decode_params(
            prefill_params,
            retention_s=retention_s if hints else None,
            ticket=ticket if hints else None,
            release=[request_id for held in releases for request_id in held.request_ids()],
        )
        if params:
            body = {**body, wire.KV_TRANSFER_PARAMS: params}
        return DecodeRequest(body, ticket, releases)

    async def _issue_ticket(self, turn: Turn, engine: Engine, retention_s: float) -> str | None:
        """A ticket when this turn's KV is to be kept for the session's next turn."""
        key = turn.request.session_key
        if key is None or retention_s <= 0:
            return None
        ticket = await self.keeper.issue(
            key,
            engine.url,
            turn.request.model,
            retention_s,
            streamed=turn.request.stream,
            next_turn_s=turn.request.hints.next_turn_seconds,
        )
        return ticket.ticket

    async def post(
        self,
        turn: Turn,
        engine: Engine,
        body: dict[str, Any],
        timeout: Timeout,
        *,
        stall_s: float | None = None,
        probe_first: bool = True,
    ) -> dict[str, Any]:
        """One non-streamed step on ``engine``: counted in flight, under the watchdog (which
        ends it once ``engine`` makes no progress for ``stall_s``: Watchdog.run). A step that
        runs out of its ``timeout`` fails as ``deadline``: its engine was busy, not dead."""
        engine.request_started()  # as engine.busy(), without a generator per step
        ends = _ends(timeout)
        try:
            return await self.watchdog.run(
                engine,
                post_json(self.http, engine, turn.wire.path, body, turn.request.headers, timeout),
                stall_s=stall_s,
                probe_first=probe_first,
            )
        except EngineFailure as failure:
            if _ran_out(failure, ends):
                raise _deadline(failure) from failure
            raise
        finally:
            engine.request_finished()

    async def queued(
        self, turn: Turn, engine: Engine, tokens: int, *, keeping: Holding | None = None
    ) -> tuple[QueuedStep, Holding | None]:
        """A step of ``turn`` expected to compute ``tokens``, once the engine's queue
        (queue.StepQueue) sends it, within the turn's deadline (504 past it); then in flight
        until :meth:`post_sent` ends it. While the step is held, the holding it is to pull
        (``keeping``) is kept on its engine (HoldingKeeper.keep_while); returned as it then
        stands."""
        request, queue = turn.request, engine.queue
        sending = queue.send(tokens, turn.priority, request.tenant, turn.remaining_s())
        try:
            if keeping is None:
                step = await sending
            else:
                step, keeping = await self._kept_while_held(queue, sending, keeping)
        except asyncio.TimeoutError:
            raise self.turn_timed_out(turn, "queue") from None
        if step.waited_s:
            turn.phases["queue"] = step.waited_s
        self.metrics.record_admission_wait(turn.priority.label, request.tenant, step.waited_s)
        return step, keeping

    async def _kept_while_held(
        self, queue: StepQueue, sending: Awaitable[QueuedStep], holding: Holding
    ) -> tuple[QueuedStep, Holding]:
        sent = asyncio.ensure_future(sending)
        try:
            holding = await self.keeper.keep_while(holding, sent)
            return await sent, holding
        except BaseException:
            if not sent.done():
                sent.cancel()  # the turn leaves the queue
            elif not sent.cancelled() and sent.exception() is None:
                queue.ended(sent.result())  # sent as the turn gave up: not in flight after all
            raise

    async def post_sent(
        self,
        turn: Turn,
        engine: Engine,
        step: QueuedStep,
        body: dict[str, Any],
        *,
        stall_s: float | None = None,
    ) -> tuple[dict[str, Any], float]:
        """:meth:`post` of a step :meth:`queued` sent, within the turn's deadline: its answer
        and its service seconds, its waits in the router and behind the engine's other steps
        left out (priced apart: docs/router.md, "P's queue")."""
        try:
            answer = await self.post(
                turn, engine, body, self.timeouts.within(turn), stall_s=stall_s
            )
            return answer, engine.queue.served(step, _computed_tokens(turn, answer))
        finally:
            engine.queue.ended(step)

    async def open_stream(
        self,
        turn: Turn,
        engine: Engine,
        body: dict[str, Any],
        *,
        probe_first: bool = True,
        first_chunk_s: float | None = None,
    ) -> DecodeStream:
        """A decode stream whose first chunk is in, counted in flight until its relay ends. Its
        first chunk is due within what is left of the turn's deadline (``first_chunk_s``: that
        long from now); one not in by then fails as ``deadline``."""
        engine.request_started()
        faults = self.settings.faults
        first_chunk_s = turn.remaining_s() if first_chunk_s is None else first_chunk_s
        ends = _ends(Timeout(total=first_chunk_s))
        try:
            return await self.watchdog.run(
                engine,
                open_stream(
                    self.http,
                    engine,
                    turn.wire.path,
                    body,
                    turn.request.headers,
                    timeout=self.timeouts.decode,
                    first_chunk_s=first_chunk_s,
                    idle_s=faults.stall_s,
                    silence=Silence(
                        functools.partial(self.watchdog.unresponsive, engine),
                        after_s=faults.progress_every_s,
                        probes=faults.unanswered_probes,
                    ),
                ),
                probe_first=probe_first,
            )
        except BaseException as exc:
            engine.request_finished()
            if isinstance(exc, EngineFailure) and _ran_out(exc, ends):
                raise _deadline(exc) from exc
            raise

    def turn_timed_out(self, turn: Turn, phase: str) -> TurnTimedOut:
        """The error that ends ``turn``, out of time in ``phase``; counted."""
        self.metrics.record_turn_timed_out(phase)
        logger.info("a turn reached its deadline in its %s phase", phase)
        return TurnTimedOut(phase, self.settings.timeouts.first_token_s, turn.headers())

    def note_failure(self, turn: Turn, failure: EngineFailure, *, stalled: bool = False) -> None:
        """Count a failed step, and blame its engine unless the step ``stalled`` on a pull or
        ran out of time (``deadline``: the engine was busy)."""
        turn.failures.append(failure)
        if failure.kind == "deadline":
            return
        if stalled:
            logger.warning("%s: the pull stalled; recomputing instead", failure)
            self.metrics.record_engine_error(failure.engine.role, "stall")
            return
        self.metrics.record_engine_error(failure.engine.role, failure.kind)
        failure.engine.record_failure(failure.kind)
        if failure.kind in SUSPECT or failure.kind in LOST:
            logger.warning("%s: the engine is down until its health probe passes", failure)
        else:
            logger.debug("%s", failure)

    def record_returned(
        self, source: str | None, engine: Engine, ticket: str | None, params: dict[str, Any] | None
    ) -> None:
        """What D's returned params say besides the holding: its wait for blocks, and how its
        read of P's KV went: once per ticket (its answer or its holding report, whichever comes
        first), else for the pair of ``source`` (the P engine D read from; None for a
        decode-only step) and ``engine``."""
        self.block_waits.record(engine.role, params)
        if ticket is not None:
            self.pairs.record_ticket(ticket, params)
        else:
            self.pairs.record_params(source, engine.url, params)


def _ends(timeout: Timeout) -> float:
    """The loop time by which ``timeout.total`` runs out."""
    total = timeout.total if timeout.total is not None else math.inf
    return asyncio.get_running_loop().time() + total


def _ran_out(failure: EngineFailure, ends: float) -> bool:
    """Whether a step failed as ``timeout`` once its whole bound (ending at loop time ``ends``)
    had run out: it ran out of time, which is not the engine's failure (a connect not answered
    within its own, shorter bound still is)."""
    return (
        failure.kind == "timeout" and asyncio.get_running_loop().time() >= ends - _DEADLINE_SLACK_S
    )


def _deadline(failure: EngineFailure) -> EngineFailure:
    return EngineFailure(failure.engine, "deadline", str(failure))


def _computed_tokens(turn: Turn, answer: dict[str, Any]) -> int | None:
    """The prompt tokens a step computed, by its answer's usage (None when it has none)."""
    usage = turn.wire.prompt_usage(answer)
    if usage.prompt_tokens is None:
        return None
    return max(usage.prompt_tokens - (usage.cached_tokens or 0), 0)
