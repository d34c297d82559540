"""One turn through prefill (P) and decode (D) engines, with KV reuse and every fallback.

1. Take the session's holding (atomically: a concurrent turn of the same session gets none) and
   let the policy decide: pull it, or recompute. A pull is planned only from a holder that is
   not known lost since the holding was made and that answers now (watchdog.py).
2. P step (one output token, formats.py): the holding's params plus ``do_remote_decode`` for a
   reuse, the cold params otherwise. A failed P step is retried cold (a planned reuse becomes a
   ``fallback``) and on other P engines; with none left the turn is served decode-only.
3. D step: P's returned params plus agentkv's retention and ticket, preferring the holder as
   decode engine. A D failure before its first byte is retried on another D engine. Streams are
   passed through chunk by chunk once the first chunk is in.
   Every P and D step runs under the watchdog: a step whose engine stops answering or making
   progress is aborted within seconds and served elsewhere, and the engine is suspect.
4. The holding is replaced from D's response body (non-streamed), D's report (streamed), or
   the last event of a streamed Responses answer, whichever comes first.

The client sees an error only when no engine can serve it, or when an engine refused the
request itself (a 4xx, passed back as the engine wrote it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentkv import protocol
from agentkv_server.router.errors import RouterError
from agentkv_server.router.formats import StreamEditor, WireFormat, wire_format
from agentkv_server.router.holdings import HoldingKeeper
from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.metrics import KVPath, RouterMetrics
from agentkv_server.router.placement import Engine, EnginePool
from agentkv_server.router.policy import PrefillSample, ReusePolicy
from agentkv_server.router.sessions import Holding
from agentkv_server.router.upstream import DecodeStream, EngineFailure, open_stream, post_json
from agentkv_server.router.watchdog import Watchdog
from agentkv_server.settings import Settings

__all__ = ["COLD_PREFILL_PARAMS", "Orchestrator"]

logger = logging.getLogger(__name__)

COLD_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class _Turn:
    """What the router knows about one turn as it goes."""

    request: ClientRequest
    started: float
    holding: Holding | None = None
    reuse: bool = False
    fallback: bool = False
    pulled: bool = False
    reused_tokens: int = 0
    computed_tokens: int = 0
    prefill_params: dict[str, Any] | None = None
    failures: list[EngineFailure] = field(default_factory=list)

    @property
    def wire(self) -> WireFormat:
        return wire_format(self.request.endpoint)

    @property
    def path(self) -> KVPath:
        if self.fallback:
            return "fallback"
        return "reuse" if self.pulled else "recompute"

    def headers(self) -> dict[str, str]:
        headers = {
            protocol.HEADER_KV_PATH: self.path,
            protocol.HEADER_REUSED_TOKENS: str(self.reused_tokens),
        }
        if self.request.session_id is not None:
            headers[protocol.HEADER_RESPONSE_SESSION_ID] = self.request.session_id
        return headers


class Orchestrator:
    """Serves turns; one per app, shared by all requests."""

    def __init__(
        self,
        settings: Settings,
        http: aiohttp.ClientSession,
        prefill: EnginePool,
        decode: EnginePool,
        keeper: HoldingKeeper,
        policy: ReusePolicy,
        metrics: RouterMetrics,
    ) -> None:
        self._settings = settings
        self._http = http
        self._prefill = prefill
        self._decode = decode
        self._keeper = keeper
        self._policy = policy
        self._metrics = metrics
        timeouts = settings.timeouts
        self._watchdog = Watchdog(http, settings.faults, timeouts.health_s)
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=timeouts.prefill_s, connect=timeouts.connect_s
        )
        self._pull_timeout = aiohttp.ClientTimeout(
            total=min(timeouts.pull_s, timeouts.prefill_s), connect=timeouts.connect_s
        )
        self._decode_timeout = aiohttp.ClientTimeout(
            total=timeouts.decode_s, connect=timeouts.connect_s
        )

    async def serve(self, request: ClientRequest, started: float) -> Response:
        turn = _Turn(request, started)
        await self._plan(turn)
        try:
            await self._prefill_step(turn)
        except EngineFailure as refused:
            return self._passthrough(turn, refused)
        finally:
            self._release_unpulled(turn)
        response = await self._decode_step(turn)
        if request.hints.session_end and request.session_key is not None:
            await self._end_session(request.session_key)
        return response

    async def _end_session(self, key: str) -> None:
        """After a session's last turn: refuse holdings of turns still in flight, free any kept."""
        holding = await self._keeper.store.end(key, time.time())
        if holding is not None:
            self._keeper.release_soon([holding])

    async def _plan(self, turn: _Turn) -> None:
        key = turn.request.session_key
        if key is None:
            return
        holding = await self._keeper.store.take(key)
        if holding is None:
            return
        turn.holding = holding
        decision = self._policy.decide(holding, time.time())
        if not decision.reuse:
            logger.debug("session %s: recompute (%s)", key, decision.reason)
            return
        holder = self._decode.get(holding.decode_url)
        if (
            holder is None
            or not holder.healthy
            or not holder.may_hold(holding.issued_at)
            or not await self._holder_answers(holder)
        ):
            turn.fallback = True  # the holder cannot answer: a pull would wait on it
            return
        turn.reuse = True

    async def _holder_answers(self, holder: Engine) -> bool:
        problem = await self._watchdog.unanswered(holder)
        if problem is None:
            return True
        logger.warning("holder %s does not answer (%s): recomputing", holder.url, problem)
        self._metrics.record_engine_error(holder.role, problem)
        return False

    async def _prefill_step(self, turn: _Turn) -> None:
        """Run P; leaves ``turn.prefill_params`` None when the turn must be served decode-only.

        Raises EngineFailure only when P refused the request itself (4xx on a cold step).
        """
        excluded: list[Engine] = []
        while (engine := self._prefill.pick(exclude=excluded)) is not None:
            pulling = turn.reuse
            params = self._prefill_params(turn)
            began = time.monotonic()
            try:
                with engine.busy():
                    answer = await self._watchdog.run(
                        engine,
                        post_json(
                            self._http,
                            engine,
                            turn.wire.path,
                            turn.wire.prefill_body(turn.request.body, params),
                            turn.request.headers,
                            self._pull_timeout if pulling else self._prefill_timeout,
                        ),
                    )
            except EngineFailure as failure:
                # A pulling step out of time or progress has stalled on the KV path (a holder
                # that died mid-transfer leaves P's request waiting): no reason to drop P.
                stalled = pulling and failure.kind in ("timeout", "stall")
                self._note_failure(turn, failure, stalled=stalled)
                if failure.is_client_error and not pulling:
                    raise
                if pulling:  # the pull may be what failed: retry cold, on this engine if it answers
                    turn.reuse, turn.fallback = False, True
                if (failure.engine_unreachable and not stalled) or not pulling:
                    excluded.append(engine)
                continue
            self._account_prefill(turn, answer, time.monotonic() - began)
            params = answer.get("kv_transfer_params")
            turn.prefill_params = params if isinstance(params, dict) else {}
            return
        if turn.reuse:
            turn.reuse, turn.fallback = False, True

    def _prefill_params(self, turn: _Turn) -> dict[str, Any]:
        if turn.reuse and turn.holding is not None:
            return {**turn.holding.params, "do_remote_decode": True}
        return dict(COLD_PREFILL_PARAMS)

    def _account_prefill(self, turn: _Turn, answer: dict[str, Any], seconds: float) -> None:
        """Reused and computed tokens from P's usage, and a rate sample for the policy.

        Reused tokens are P's ``prompt_tokens_details.cached_tokens`` when the engine reports
        them; otherwise the holding's ``remote_num_tokens`` clipped to the prompt. A reported
        count under half of what was planned means the pull failed and P recomputed.
        """
        usage = turn.wire.prompt_usage(answer)
        prompt_tokens, cached = usage.prompt_tokens, usage.cached_tokens
        if turn.reuse and turn.holding is not None:
            planned = turn.holding.num_tokens
            if prompt_tokens is not None:
                planned = min(planned, prompt_tokens)
            if cached is None:
                turn.reused_tokens, turn.pulled = planned, True
            elif cached * 2 < planned:
                turn.fallback = True
            else:
                turn.reused_tokens, turn.pulled = min(cached, planned), True
        if prompt_tokens is None:
            return
        already = cached if cached is not None else turn.reused_tokens
        turn.computed_tokens = max(prompt_tokens - already, 0)
        self._policy.observe(PrefillSample(turn.computed_tokens, turn.reused_tokens, seconds))

    def _release_unpulled(self, turn: _Turn) -> None:
        """A taken holding that this turn did not pull still occupies the holder: free it."""
        if turn.holding is not None and not turn.pulled:
            self._keeper.release_soon([turn.holding])

    async def _decode_step(self, turn: _Turn) -> Response:
        request = turn.request
        # Without the store nothing could record this turn's KV: ask the engine to keep none.
        keep = request.session_key is not None and self._keeper.store.available
        retention_s = self._policy.retention_s(request.hints) if keep else 0.0
        prefer = turn.holding.decode_url if turn.holding is not None else None
        excluded: list[Engine] = []
        for _ in range(self._settings.decode_attempts):
            engine = self._decode.pick(prefer=prefer, exclude=excluded)
            if engine is None:
                break
            ticket = await self._issue_ticket(turn, engine, retention_s)
            body = self._decode_body(turn, retention_s, ticket)
            try:
                if request.stream:
                    return await self._stream(turn, engine, body, ticket)
                return await self._complete(turn, engine, body, ticket)
            except EngineFailure as failure:
                self._note_failure(turn, failure)
                if failure.is_client_error:
                    return self._passthrough(turn, failure)
                excluded.append(engine)
                if failure.engine_stuck:
                    # D may have been waiting on P's KV (P gone after its step): the next D
                    # computes the prompt itself rather than wait on the same transfer.
                    turn.prefill_params = None
        raise _unservable(turn)

    async def _issue_ticket(self, turn: _Turn, engine: Engine, retention_s: float) -> str | None:
        """A ticket when this turn's KV is to be kept for the session's next turn."""
        key = turn.request.session_key
        if key is None or retention_s <= 0:
            return None
        ticket = await self._keeper.issue(key, engine.url, turn.request.model, retention_s)
        return ticket.ticket

    def _decode_body(self, turn: _Turn, retention_s: float, ticket: str | None) -> dict[str, Any]:
        params = dict(turn.prefill_params or {})
        if self._policy.sends_hints:
            params["agentkv_retention_seconds"] = retention_s
            if ticket is not None:
                params["agentkv_ticket"] = ticket
        if not params:
            return turn.request.body
        return {**turn.request.body, "kv_transfer_params": params}

    async def _complete(
        self, turn: _Turn, engine: Engine, body: dict[str, Any], ticket: str | None
    ) -> Response:
        with engine.busy():
            answer = await self._watchdog.run(
                engine,
                post_json(
                    self._http,
                    engine,
                    turn.wire.path,
                    body,
                    turn.request.headers,
                    self._decode_timeout,
                ),
            )
        self._record_turn(turn)
        params = answer.pop("kv_transfer_params", None)
        if ticket is not None and isinstance(params, dict):
            await self._keeper.record(ticket, params)
        return JSONResponse(answer, headers=turn.headers())

    async def _stream(
        self, turn: _Turn, engine: Engine, body: dict[str, Any], ticket: str | None
    ) -> Response:
        engine.inflight += 1
        try:
            stream = await self._watchdog.run(
                engine,
                open_stream(
                    self._http,
                    engine,
                    turn.wire.path,
                    body,
                    turn.request.headers,
                    timeout=self._decode_timeout,
                    first_chunk_s=self._settings.timeouts.first_token_s,
                    idle_s=self._settings.faults.stall_s,
                ),
            )
        except BaseException:
            engine.inflight -= 1
            raise
        self._record_turn(turn)
        return StreamingResponse(
            self._relay(stream, engine, ticket, turn.wire.stream_editor()),
            media_type=stream.content_type,
            headers=turn.headers(),
        )

    async def _relay(
        self, stream: DecodeStream, engine: Engine, ticket: str | None, editor: StreamEditor
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream.chunks():
                head, final = editor.feed(chunk)
                if head:
                    yield head
                if final is None:
                    continue
                if ticket is not None:
                    await self._hold_back_final(ticket, editor.kv_transfer_params)
                yield final
            if rest := editor.flush():
                yield rest
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # Bytes already went out: the client's stream just ends early.
            logger.warning("decode stream from %s broke: %r", engine.url, exc)
            self._metrics.record_engine_error("decode", "stream")
            engine.mark_suspect()
        finally:
            stream.close()
            engine.inflight -= 1

    async def _hold_back_final(self, ticket: str, params: dict[str, Any] | None) -> None:
        """The stream's end tells the client it may send its next turn: hold it back until this
        turn's holding is recorded (from the stream itself or D's report), or that turn would
        recompute."""
        if params is not None:
            await self._keeper.record(ticket, params)
        await self._keeper.wait_recorded(ticket, self._settings.timeouts.report_s)

    def _record_turn(self, turn: _Turn) -> None:
        self._metrics.record_turn(
            turn.path, time.monotonic() - turn.started, turn.reused_tokens, turn.computed_tokens
        )

    def _note_failure(self, turn: _Turn, failure: EngineFailure, *, stalled: bool = False) -> None:
        turn.failures.append(failure)
        if stalled:
            logger.warning("%s: the pull stalled; recomputing instead", failure)
            self._metrics.record_engine_error(failure.engine.role, "stall")
            return
        self._metrics.record_engine_error(failure.engine.role, failure.kind)
        if failure.kind == "connect":
            logger.debug("%s", failure)
            failure.engine.mark_lost()
        elif failure.engine_stuck:
            logger.warning("%s: the engine is suspect until its health probe passes", failure)
            failure.engine.mark_suspect()
        else:
            logger.debug("%s", failure)

    def _passthrough(self, turn: _Turn, refused: EngineFailure) -> Response:
        """An engine's own 4xx, handed back as it wrote it."""
        return Response(
            refused.body,
            status_code=refused.status or 400,
            media_type=refused.content_type,
            headers=turn.headers(),
        )


def _unservable(turn: _Turn) -> RouterError:
    if not turn.failures:
        return RouterError(
            503,
            "No healthy decode engine is available.",
            type="server_error",
            code="no_engine_available",
        )
    return RouterError(
        502,
        f"No engine could serve the request: {turn.failures[-1]}",
        type="server_error",
        code="engine_failure",
    )
