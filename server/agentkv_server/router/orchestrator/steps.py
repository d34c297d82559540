"""The prefill (P) and decode (D) steps, as the attempt loop tries them.

P computes the prompt (pulling the history from its holder when the plan says so) and returns
the params D reads its KV with. D answers the client: on the holder alone for a ``local`` turn,
else on the engine whose pair with P works best, preferring the holder. A stream is answered once
its first chunk is in (so a D failure before it is retried elsewhere) and then relayed
(relay.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from starlette.responses import Response

from agentkv_server import wire
from agentkv_server.router.codec import JSONBytesResponse
from agentkv_server.router.formats import StreamEditor
from agentkv_server.router.orchestrator.accounting import (
    account_local,
    account_prefill,
    log_breakdown,
    record_turn,
)
from agentkv_server.router.orchestrator.attempts import Attempt, Then
from agentkv_server.router.orchestrator.plan import Plan
from agentkv_server.router.orchestrator.relay import Relay, Relayed
from agentkv_server.router.orchestrator.services import Services
from agentkv_server.router.placement import Engine
from agentkv_server.router.resume import ResumableStream, resumable, tracked_body
from agentkv_server.router.streaming import RelayResponse
from agentkv_server.router.turn import KVPath, Turn
from agentkv_server.router.upstream import EngineFailure

__all__ = ["DecodeAttempt", "PrefillAttempt", "Prefilled", "prefill_tokens"]


class Prefilled(NamedTuple):
    """A P step done: the params D reads its KV with, from which engine, and whether P pulled
    the holding as planned."""

    params: dict[str, Any]
    url: str
    pulled: bool

    @property
    def source(self) -> str | None:
        """The P engine whose KV D reads; None when P returned nothing to read."""
        return self.url if self.params else None


class PrefillAttempt(Attempt[Prefilled]):
    """P: a pull while the plan's pull has not failed, then cold.

    The holder is the decode engine the turn prefers (and a pull's source): P is picked by its
    pair with it. Only a pull tests the pair here; else D's read will.
    """

    __slots__ = ("_holding", "_plan", "_pulling")

    def __init__(self, services: Services, turn: Turn, plan: Plan) -> None:
        super().__init__(services, turn)
        self._plan = plan
        self._pulling = plan.path is KVPath.PULL
        self._holding = plan.holding

    @property
    def pulling(self) -> bool:
        """Whether the step pulls the holding: planned, and no try of it has failed yet."""
        return self._pulling

    def pick(self, excluded: Sequence[Engine]) -> Engine | None:
        services = self.services
        return services.pairs.pick(
            services.prefill, self._plan.holder_url, exclude=excluded, trial=self._pulling
        )

    async def send(self, engine: Engine) -> Prefilled:
        services, turn, plan = self.services, self.turn, self._plan
        pulling = self._pulling
        tokens = prefill_tokens(services, turn, plan, pulling)
        keeping = self._holding if pulling else None
        step, kept = await services.queued(turn, engine, tokens, keeping=keeping)
        if kept is not None:
            self._holding = kept  # renewed while the step was held
        if pulling and self._holding is not None:
            params = wire.pull_prefill_params(self._holding.params)
        else:
            params = wire.cold_prefill_params()
        body = turn.wire.prefill_body(turn.request.body, params)
        # A pull is given up once P makes no progress for pull_s, not after pull_s in all: on a
        # busy P it waits its turn behind other prompts (docs/router.md, "Failure handling").
        settings = services.settings
        stall_s = min(settings.timeouts.pull_s, settings.faults.stall_s) if pulling else None
        answer, seconds = await services.post_sent(turn, engine, step, body, stall_s=stall_s)
        pulled_from = plan.holding if pulling else None
        pulled = account_prefill(
            turn, services.policy, answer, pulled_from, seconds, plan.holder_running > 0
        )
        if turn.prompt_tokens is not None:
            services.prompt_sizes.observe(turn.request, turn.prompt_tokens)
        returned = answer.get(wire.KV_TRANSFER_PARAMS)
        # How P's pull from the holder went, and P's wait for blocks (taken out: D must not
        # take them for its own).
        services.pairs.record_params(engine.url, plan.holder_url if pulling else None, returned)
        services.block_waits.record(engine.role, returned)
        return Prefilled(returned if isinstance(returned, dict) else {}, engine.url, pulled)

    def stalled(self, failure: EngineFailure) -> bool:
        # A pulling step out of time or progress has stalled on the KV path (a holder that
        # died mid-transfer leaves P's request waiting): no reason to drop P.
        return self._pulling and failure.kind in ("timeout", "stall")

    def then(self, failure: EngineFailure) -> Then:
        pulling, stalled = self._pulling, self.stalled(failure)
        if failure.is_client_error and not pulling:
            return Then.REFUSED
        self._pulling = False  # the pull may be what failed: retry cold, on P if it answers
        if pulling and (stalled or not failure.engine_unreachable):
            return Then.AGAIN
        return Then.ELSEWHERE


def prefill_tokens(services: Services, turn: Turn, plan: Plan, pulling: bool) -> int:
    """What P is expected to compute for ``turn``: the prompt as the holder counted it, else as
    its size suggests, less the holding a pull brings."""
    prompt = plan.prompt_tokens
    if prompt is None:
        prompt = services.prompt_sizes.estimate(turn.request)
    held = plan.holding.num_tokens if pulling and plan.holding is not None else 0
    return max(prompt - held, 0)


class DecodeAttempt(Attempt[Response]):
    """D: the client's answer, with P's KV (``prefilled``) or decode-only, or on ``holder``
    alone (a local turn)."""

    __slots__ = ("_holder", "_patient", "_plan", "_prefilled", "_retention_s")

    def __init__(
        self,
        services: Services,
        turn: Turn,
        plan: Plan,
        prefilled: Prefilled | None = None,
        *,
        holder: Engine | None = None,
    ) -> None:
        super().__init__(services, turn)
        self._plan = plan
        self._prefilled = prefilled
        self._holder = holder
        self._retention_s = services.kept_s(plan.retention_s)
        self._patient = False  # after probes went unanswered: judged by its progress alone

    def pick(self, excluded: Sequence[Engine]) -> Engine | None:
        if self._holder is not None:
            return None if self._holder in excluded else self._holder
        services = self.services
        return services.pairs.pick(
            services.decode, self._source, prefer=self._plan.holder_url, exclude=excluded
        )

    async def send(self, engine: Engine) -> Response:
        services, turn = self.services, self.turn
        prefill_params = self._prefilled.params if self._prefilled is not None else None
        continued = self._plan.holding if self._continues_holding else None
        body, ticket, releases = await services.decode_request(
            turn, engine, turn.request.body, prefill_params, self._retention_s,
            tokens=self._tokens, continued=continued,
        )  # fmt: skip
        if ticket is not None and self._source is not None:
            services.pairs.expect(ticket, self._source, engine.url)
        with services.keeper.released_if_failed(releases):
            if turn.request.stream:
                return await self._stream(engine, body, ticket)
            return await self._complete(engine, body, ticket)

    def then(self, failure: EngineFailure) -> Then:
        if failure.is_client_error:
            return Then.REFUSED
        if failure.engine_stuck:
            # D may have been waiting on P's KV (P gone after its step): the next D computes
            # the prompt itself rather than wait on the same transfer.
            self._prefilled = None
        if failure.kind == "hang" and self._only_decode_engine(failure.engine):
            # Its health probes went unanswered, but it refused nothing: a busy core answers
            # late too (on the pressure preset a loaded decode engine's cold turn failed so).
            # With no other engine, it is tried again and judged by its progress alone.
            self._patient = True
            return Then.AGAIN
        return Then.ELSEWHERE

    def _only_decode_engine(self, engine: Engine) -> bool:
        return all(other is engine for other in self.services.decode.engines)

    @property
    def _continues_holding(self) -> bool:
        """A local step on the holder, whose holding still occupies it (not the host tier)."""
        return self._holder is not None and self._plan.occupies_holder

    @property
    def _tokens(self) -> int:
        """The prompt's tokens, as P or the holder counted them (0 when neither did)."""
        return self.turn.prompt_tokens or self._plan.prompt_tokens or 0

    @property
    def _source(self) -> str | None:
        return self._prefilled.source if self._prefilled is not None else None

    async def _complete(self, engine: Engine, body: dict[str, Any], ticket: str | None) -> Response:
        services, turn = self.services, self.turn
        began = time.monotonic()
        answer = await services.post(
            turn, engine, body, services.timeouts.decode, probe_first=not self._patient
        )
        turn.phases["decode"] = time.monotonic() - began
        if turn.local:
            account_local(turn, self._plan, services.policy, answer)
        record_turn(services.metrics, turn)
        params = answer.pop(wire.KV_TRANSFER_PARAMS, None)
        services.record_returned(self._source, engine, ticket, params)
        if ticket is not None and isinstance(params, dict):
            await services.keeper.record(ticket, params)
        log_breakdown(turn)
        return JSONBytesResponse(answer, headers=turn.headers())

    async def _stream(self, engine: Engine, body: dict[str, Any], ticket: str | None) -> Response:
        services, turn = self.services, self.turn
        began = time.monotonic()
        endpoint = turn.request.endpoint
        editor: StreamEditor = turn.wire.stream_editor()
        if resumable(endpoint, body):
            wants_ids = bool(body.get("return_token_ids"))
            editor = ResumableStream(endpoint, client_wants_ids=wants_ids)
            body = tracked_body(endpoint, body)
        probe_first = not self._patient
        if turn.local:  # the other streams' gaps until its first byte show what it costs
            with engine.steps.local_prefill(self._plan.prompt_tokens or 0):
                stream = await services.open_stream(turn, engine, body, probe_first=probe_first)
        else:
            stream = await services.open_stream(turn, engine, body, probe_first=probe_first)
        turn.phases["decode"] = time.monotonic() - began
        if turn.local:
            account_local(turn, self._plan, services.policy, None)
        elif self._prefilled is not None:  # D read P's blocks: what pull and recompute add
            services.policy.observe_handoff(turn.phases["decode"])
        record_turn(services.metrics, turn)
        relay = Relay(services, turn, self._plan, editor, self._source)
        return RelayResponse(
            relay.chunks(Relayed(stream, engine, ticket)),
            media_type=stream.content_type,
            headers=turn.headers(),
        )
