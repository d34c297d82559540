"""One turn through prefill (P) and decode (D) engines, with KV reuse and every fallback.

1. Take the session's holding (atomically: a concurrent turn of the same session gets none),
   count the prompt's new tokens on the holder (tokens.py) and let the policy decide: continue
   on the holder (``local``), pull, or recompute. Local turns and pulls are planned only on a
   holder that is not known lost since the holding was made and that answers now (watchdog.py).
   A local turn skips step 2 and is the D step of 3 on the holder; if the holder fails before
   its first byte, the turn is recomputed through P on another decode engine (a ``fallback``).
2. P step (one output token, formats.py): the holding's params plus ``do_remote_decode`` for a reuse, the
   cold params otherwise. A failed P step is retried cold (a planned reuse becomes a
   ``fallback``) and on other P engines; with none left the turn is served decode-only.
3. D step: P's returned params plus agentkv's retention and ticket, preferring the holder as
   decode engine, among engines whose KV transfers with P work (pairs.py; so is P picked by its
   pair with the holder). A D failure before its first byte is retried on another D engine.
   Streams are passed through chunk by chunk once the first chunk is in.
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
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from agentkv_server import wire
from agentkv_server.router.codec import JSONBytesResponse
from agentkv_server.router.errors import RouterError
from agentkv_server.router.failures import LOST, SUSPECT, wire_kind
from agentkv_server.router.formats import StreamEditor
from agentkv_server.router.holdings import HoldingKeeper
from agentkv_server.router.http_client import HTTPClient, HTTPError, Timeout
from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.pairs import PairHealth
from agentkv_server.router.placement import Engine, EnginePool
from agentkv_server.router.policy import PrefillSample, ReusePolicy, TurnLoad
from agentkv_server.router.resume import (
    ResumableStream,
    continuation_body,
    resumable,
    tracked_body,
)
from agentkv_server.router.streaming import RelayResponse
from agentkv_server.router.tokens import count_prompt_tokens
from agentkv_server.router.turn import KVPath, Turn
from agentkv_server.router.upstream import DecodeStream, EngineFailure, open_stream, post_json
from agentkv_server.router.watchdog import Watchdog
from agentkv_server.settings import Settings, Timeouts

__all__ = ["Orchestrator"]

logger = logging.getLogger(__name__)


class Orchestrator:
    """Serves turns; one per app, shared by all requests."""

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
        self._settings = settings
        self._http = http
        self._prefill = prefill
        self._decode = decode
        self._keeper = keeper
        self._policy = policy
        self._metrics = metrics
        # Each prefill/decode pair's KV transfer health; the app records holding reports here.
        self.pairs = PairHealth(
            settings.pairs,
            metrics=metrics,
            pairs=[(p.url, d.url) for p in prefill.engines for d in decode.engines],
        )
        timeouts = settings.timeouts
        self._watchdog = Watchdog(http, settings.faults, timeouts.health_s)
        self._prefill_timeout = _step_timeout(timeouts, timeouts.prefill_s)
        self._pull_timeout = _step_timeout(timeouts, min(timeouts.pull_s, timeouts.prefill_s))
        self._decode_timeout = _step_timeout(timeouts, timeouts.decode_s)
        self._tokenize_timeout = _step_timeout(timeouts, timeouts.tokenize_s)

    async def serve(self, request: ClientRequest, started: float) -> Response:
        turn = Turn(request, started)
        await self._plan(turn)
        turn.phases["plan"] = time.monotonic() - started
        excluded: list[Engine] = []
        if turn.local:
            response = await self._local_step(turn, excluded)
            if response is not None:
                return await self._after(turn, response)
        began = time.monotonic()
        try:
            await self._prefill_step(turn)
        except EngineFailure as refused:
            return self._passthrough(turn, refused)
        finally:
            self._release_unpulled(turn)
            turn.phases["prefill"] = time.monotonic() - began
        return await self._after(turn, await self._decode_step(turn, excluded))

    async def _after(self, turn: Turn, response: Response) -> Response:
        request = turn.request
        if request.hints.session_end and request.session_key is not None:
            await self._keeper.end_soon(request.session_key)
        return response

    async def _plan(self, turn: Turn) -> None:
        key = turn.request.session_key
        if key is None:
            return
        holding = await self._keeper.take(key)
        if holding is None:
            return
        turn.holding = holding
        holder = self._decode.get(holding.decode_url)
        if holder is not None and not holder.may_serve_holding(holding.issued_at):
            holder = None
        load = await self._turn_load(turn, holder) if holder is not None else None
        decision = self._policy.decide(holding, time.time(), load)
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
            return
        if holder is None or not await self._holder_answers(holder):
            turn.fall_back()  # the holder cannot answer: a pull would wait on it
            return
        turn.path = decision.path

    async def _turn_load(self, turn: Turn, holder: Engine) -> TurnLoad | None:
        """The new part's size and the holder's load; None when the holder cannot count it."""
        if not self._policy.considers_local:
            return None
        try:
            prompt_tokens = await count_prompt_tokens(
                self._http, holder, turn.request, turn.request.headers, self._tokenize_timeout
            )
        except EngineFailure as failure:
            logger.debug("%s: planning without the local path", failure)
            return None
        holder.mark_answered()
        if prompt_tokens is None or turn.holding is None:
            return None
        turn.prompt_tokens = prompt_tokens
        new_tokens = max(prompt_tokens - turn.holding.num_tokens, 0)
        return TurnLoad(new_tokens=new_tokens, holder_running=holder.inflight)

    async def _local_step(self, turn: Turn, excluded: list[Engine]) -> Response | None:
        """The turn on its holder without a P step; None (now a fallback) if the holder failed
        before its first byte, with the holder added to ``excluded``."""
        assert turn.holding is not None
        holding = turn.holding
        holder = self._decode.get(holding.decode_url)
        assert holder is not None
        retention_s = self._retention_s(turn)
        ticket = await self._issue_ticket(turn, holder, retention_s)
        body = self._decode_body(turn, retention_s, ticket)
        try:
            if turn.request.stream:
                response = await self._stream(turn, holder, body, ticket)
            else:
                response = await self._complete(turn, holder, body, ticket)
        except EngineFailure as failure:
            self._note_failure(turn, failure)
            if failure.is_client_error:
                self._keeper.release_soon([holding])
                return self._passthrough(turn, failure)
            logger.warning("local turn on %s failed (%s): recomputing", holder.url, failure.kind)
            turn.fall_back()
            excluded.append(holder)
            return None
        # The new request holds the history's blocks now (prefix hit): the old lease can go.
        self._keeper.release_soon([holding])
        return response

    def _account_local(self, turn: Turn, answer: dict[str, Any] | None) -> None:
        """Reused tokens of a local turn: the engine's cached count, else the holding's."""
        assert turn.holding is not None
        usage = turn.wire.prompt_usage(answer) if answer is not None else None
        prompt_tokens = usage.prompt_tokens if usage is not None else None
        cached = usage.cached_tokens if usage is not None else None
        prompt_tokens = prompt_tokens if prompt_tokens is not None else turn.prompt_tokens
        held = turn.holding.num_tokens
        if cached is not None:
            turn.reused_tokens = cached
        else:
            turn.reused_tokens = held if prompt_tokens is None else min(held, prompt_tokens)
        if prompt_tokens is not None:
            turn.computed_tokens = max(prompt_tokens - turn.reused_tokens, 0)
        if turn.request.stream:  # a non-streamed answer's time includes its whole decode
            self._policy.observe_local(turn.computed_tokens, turn.phases["decode"])

    async def _holder_answers(self, holder: Engine) -> bool:
        problem = await self._watchdog.unanswered(holder)
        if problem is None:
            return True
        logger.warning("holder %s does not answer (%s): recomputing", holder.url, problem)
        self._metrics.record_engine_error(holder.role, problem)
        return False

    async def _prefill_step(self, turn: Turn) -> None:
        """Run P; leaves ``turn.prefill_params`` None when the turn must be served decode-only.

        Raises EngineFailure only when P refused the request itself (4xx on a cold step).
        """
        excluded: list[Engine] = []
        # The holder is the decode engine the turn prefers (and a pull's source): pick a P
        # whose pair with it works. Only a pull tests the pair here; else D's read will.
        holder = turn.holding.decode_url if turn.holding is not None else None
        while (
            engine := self.pairs.pick(self._prefill, holder, exclude=excluded, trial=turn.pulls)
        ) is not None:
            pulling = turn.pulls
            params = self._prefill_params(turn)
            began = time.monotonic()
            body = turn.wire.prefill_body(turn.request.body, params)
            timeout = self._pull_timeout if pulling else self._prefill_timeout
            try:
                answer = await self._post(turn, engine, body, timeout)
            except EngineFailure as failure:
                # A pulling step out of time or progress has stalled on the KV path (a holder
                # that died mid-transfer leaves P's request waiting): no reason to drop P.
                stalled = pulling and failure.kind in ("timeout", "stall")
                self._note_failure(turn, failure, stalled=stalled)
                if failure.is_client_error and not pulling:
                    raise
                if pulling:  # the pull may be what failed: retry cold, on this engine if it answers
                    turn.fall_back()
                if (failure.engine_unreachable and not stalled) or not pulling:
                    excluded.append(engine)
                continue
            self._account_prefill(turn, answer, time.monotonic() - began)
            params = answer.get(wire.KV_TRANSFER_PARAMS)
            # How P's pull from the holder went (taken out: D must not take it for its own).
            self.pairs.record_params(engine.url, holder if pulling else None, params)
            turn.prefill_params = params if isinstance(params, dict) else {}
            turn.prefill_url = engine.url
            return
        if turn.pulls:
            turn.fall_back()

    def _prefill_params(self, turn: Turn) -> dict[str, Any]:
        if turn.pulls and turn.holding is not None:
            return wire.pull_prefill_params(turn.holding.params)
        return wire.cold_prefill_params()

    def _account_prefill(self, turn: Turn, answer: dict[str, Any], seconds: float) -> None:
        """Reused and computed tokens from P's usage, and a rate sample for the policy.

        Reused tokens are P's ``prompt_tokens_details.cached_tokens`` when the engine reports
        them; otherwise the holding's ``remote_num_tokens`` clipped to the prompt. A reported
        count under half of what was planned means the pull failed and P recomputed.
        """
        usage = turn.wire.prompt_usage(answer)
        prompt_tokens, cached = usage.prompt_tokens, usage.cached_tokens
        if turn.pulls and turn.holding is not None:
            planned = turn.holding.num_tokens
            if prompt_tokens is not None:
                planned = min(planned, prompt_tokens)
            if cached is None:
                turn.reused_tokens = planned
            elif cached * 2 < planned:
                turn.fall_back()
            else:
                turn.reused_tokens = min(cached, planned)
        if prompt_tokens is None:
            return
        already = cached if cached is not None else turn.reused_tokens
        turn.computed_tokens = max(prompt_tokens - already, 0)
        self._policy.observe(PrefillSample(turn.computed_tokens, turn.reused_tokens, seconds))

    def _release_unpulled(self, turn: Turn) -> None:
        """A taken holding that this turn did not pull still occupies the holder: free it."""
        if turn.holding is not None and not turn.pulls:
            self._keeper.release_soon([turn.holding])

    def _retention_s(self, turn: Turn) -> float:
        # Without the store nothing could record this turn's KV: ask the engine to keep none.
        request = turn.request
        keep = request.session_key is not None and self._keeper.keeps_holdings
        return self._policy.retention_s(request.hints) if keep else 0.0

    async def _decode_step(self, turn: Turn, excluded: list[Engine]) -> Response:
        request = turn.request
        retention_s = self._retention_s(turn)
        prefer = turn.holding.decode_url if turn.holding is not None else None
        for _ in range(self._settings.decode_attempts):
            prefill_url = _prefill_url(turn)
            engine = self.pairs.pick(self._decode, prefill_url, prefer=prefer, exclude=excluded)
            if engine is None:
                break
            ticket = await self._issue_ticket(turn, engine, retention_s)
            if ticket is not None and prefill_url is not None:
                self.pairs.expect(ticket, prefill_url, engine.url)
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

    async def _issue_ticket(self, turn: Turn, engine: Engine, retention_s: float) -> str | None:
        """A ticket when this turn's KV is to be kept for the session's next turn."""
        key = turn.request.session_key
        if key is None or retention_s <= 0:
            return None
        ticket = await self._keeper.issue(
            key, engine.url, turn.request.model, retention_s, streamed=turn.request.stream
        )
        return ticket.ticket

    def _decode_body(
        self,
        turn: Turn,
        retention_s: float,
        ticket: str | None,
        continuation: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The client's body (or a broken stream's ``continuation``, computed on D alone) with
        D's params: P's, the retention and the ticket."""
        body = turn.request.body if continuation is None else continuation
        prefill = turn.prefill_params if continuation is None else None
        hints = self._policy.sends_hints
        params = wire.decode_params(
            prefill,
            retention_s=retention_s if hints else None,
            ticket=ticket if hints else None,
        )
        if not params:
            return body
        return {**body, wire.KV_TRANSFER_PARAMS: params}

    async def _post(
        self, turn: Turn, engine: Engine, body: dict[str, Any], timeout: Timeout
    ) -> dict[str, Any]:
        """One non-streamed step on ``engine``: counted in flight, under the watchdog."""
        with engine.busy():
            return await self._watchdog.run(
                engine,
                post_json(self._http, engine, turn.wire.path, body, turn.request.headers, timeout),
            )

    async def _complete(
        self, turn: Turn, engine: Engine, body: dict[str, Any], ticket: str | None
    ) -> Response:
        began = time.monotonic()
        answer = await self._post(turn, engine, body, self._decode_timeout)
        turn.phases["decode"] = time.monotonic() - began
        if turn.local:
            self._account_local(turn, answer)
        self._record_turn(turn)
        params = answer.pop(wire.KV_TRANSFER_PARAMS, None)
        self._record_pair(turn, engine, ticket, params)
        if ticket is not None and isinstance(params, dict):
            await self._keeper.record(ticket, params)
        _log_breakdown(turn)
        return JSONBytesResponse(answer, headers=turn.headers())

    async def _stream(
        self, turn: Turn, engine: Engine, body: dict[str, Any], ticket: str | None
    ) -> Response:
        began = time.monotonic()
        endpoint = turn.request.endpoint
        editor: StreamEditor = turn.wire.stream_editor()
        if resumable(endpoint, body):
            wants_ids = bool(body.get("return_token_ids"))
            editor = ResumableStream(endpoint, client_wants_ids=wants_ids)
            body = tracked_body(endpoint, body)
        stream = await self._open_stream(turn, engine, body)
        turn.phases["decode"] = time.monotonic() - began
        if turn.local:
            self._account_local(turn, None)
        elif turn.prefill_params is not None:  # D read P's blocks: what pull and recompute add
            self._policy.observe_handoff(turn.phases["decode"])
        self._record_turn(turn)
        return RelayResponse(
            self._relay(turn, _Relayed(stream, engine, ticket), editor),
            media_type=stream.content_type,
            headers=turn.headers(),
        )

    async def _open_stream(self, turn: Turn, engine: Engine, body: dict[str, Any]) -> DecodeStream:
        """A decode stream whose first chunk is in, counted in flight until its relay ends."""
        engine.request_started()
        try:
            return await self._watchdog.run(
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
            engine.request_finished()
            raise

    async def _relay(
        self, turn: Turn, relayed: _Relayed, editor: StreamEditor
    ) -> AsyncGenerator[bytes, None]:
        """Pass the stream on; one that breaks is continued elsewhere when it can be."""
        resumes = 0
        try:
            while True:
                broke, error = None, None
                try:
                    async for part in self._pass_on(turn, relayed, editor):
                        yield part
                    if not editor.ended:
                        broke = "the stream ended before its end"
                except (HTTPError, asyncio.TimeoutError) as exc:
                    broke, error = repr(exc), exc
                finally:
                    relayed.stream.close()
                    relayed.engine.request_finished()
                if broke is None:
                    return
                # Bytes already went out: continue this stream, or it just ends early.
                logger.warning("decode stream from %s broke: %s", relayed.engine.url, broke)
                self._metrics.record_engine_error("decode", "stream")
                _blame_broken_stream(relayed.engine, error)
                if not isinstance(editor, ResumableStream):
                    return
                if resumes >= self._settings.faults.stream_resumes:
                    logger.warning("stream not continued: %d continuations already", resumes)
                    return
                resumes += 1
                resumed = await self._resume(turn, relayed, editor)
                if isinstance(resumed, bytes):
                    yield resumed
                if not isinstance(resumed, _Relayed):
                    return
                relayed = resumed
        finally:
            _log_breakdown(turn)

    async def _pass_on(
        self, turn: Turn, relayed: _Relayed, editor: StreamEditor
    ) -> AsyncIterator[bytes]:
        async for chunk in relayed.stream.chunks():
            head, final = editor.feed(chunk)
            if head:
                yield head
            if final is None:
                continue
            self._record_pair(turn, relayed.engine, relayed.ticket, editor.kv_transfer_params)
            if relayed.ticket is not None:
                waited = time.monotonic()
                await self._hold_back_final(relayed.ticket, editor.kv_transfer_params)
                turn.phases["report"] = time.monotonic() - waited
            yield final
        if rest := editor.flush():
            yield rest

    async def _resume(
        self, turn: Turn, broken: _Relayed, editor: ResumableStream
    ) -> _Relayed | bytes | None:
        """The broken stream's continuation on another decode engine (decode-only: it
        recomputes prompt + answer so far); the stream's end when the answer was complete;
        None when it cannot be continued."""
        progress = editor.progress()
        if broken.ticket is not None:  # the dead engine's holding must not become the session's
            await self._keeper.void(broken.ticket)
        request = turn.request.body
        if (blocker := progress.blocker_for(request)) is not None:
            logger.warning("stream not continued: %s", blocker)
            return None
        body = continuation_body(request, progress)
        if body is None:
            return editor.finish()
        excluded = [broken.engine]
        retention_s = self._retention_s(turn)
        for _ in range(self._settings.decode_attempts):
            engine = self._decode.pick(exclude=excluded)
            if engine is None:
                break
            ticket = await self._issue_ticket(turn, engine, retention_s)
            try:
                stream = await self._open_stream(
                    turn, engine, self._decode_body(turn, retention_s, ticket, body)
                )
            except EngineFailure as failure:
                self._note_failure(turn, failure)
                excluded.append(engine)
                if failure.is_client_error:
                    break
                continue
            logger.warning(
                "stream continued on %s after %d tokens", engine.url, progress.sent_tokens
            )
            self._metrics.record_stream_resumed()
            editor.continue_stream()
            return _Relayed(stream, engine, ticket)
        logger.warning("stream not continued: no decode engine could take it over")
        return None

    async def _hold_back_final(self, ticket: str, params: dict[str, Any] | None) -> None:
        """The stream's end tells the client it may send its next turn: hold it back until this
        turn's holding is recorded (from the stream itself or D's report), or that turn would
        recompute."""
        if params is not None:
            await self._keeper.record(ticket, params)
        elif not self._policy.sends_hints:
            return  # engines sent no ticket never report: waiting would only delay the end
        await self._keeper.wait_recorded(ticket, self._settings.timeouts.report_s)

    def _record_pair(
        self, turn: Turn, engine: Engine, ticket: str | None, params: dict[str, Any] | None
    ) -> None:
        """How D's read of P's KV went, from D's returned params: once per ticket (its answer
        or its holding report, whichever comes first), else for this turn's P/D pair."""
        if ticket is not None:
            self.pairs.record_ticket(ticket, params)
        else:
            self.pairs.record_params(_prefill_url(turn), engine.url, params)

    def _record_turn(self, turn: Turn) -> None:
        self._metrics.record_turn(
            turn.path, time.monotonic() - turn.started, turn.reused_tokens, turn.computed_tokens
        )

    def _note_failure(self, turn: Turn, failure: EngineFailure, *, stalled: bool = False) -> None:
        turn.failures.append(failure)
        if stalled:
            logger.warning("%s: the pull stalled; recomputing instead", failure)
            self._metrics.record_engine_error(failure.engine.role, "stall")
            return
        self._metrics.record_engine_error(failure.engine.role, failure.kind)
        failure.engine.record_failure(failure.kind)
        if failure.kind in SUSPECT or failure.kind in LOST:
            logger.warning("%s: the engine is down until its health probe passes", failure)
        else:
            logger.debug("%s", failure)

    def _passthrough(self, turn: Turn, refused: EngineFailure) -> Response:
        """An engine's own 4xx, handed back as it wrote it."""
        return Response(
            refused.body,
            status_code=refused.status or 400,
            media_type=refused.content_type,
            headers=turn.headers(),
        )


@dataclass
class _Relayed:
    """The decode stream being passed on, its engine and its holding's ticket."""

    stream: DecodeStream
    engine: Engine
    ticket: str | None


def _prefill_url(turn: Turn) -> str | None:
    """The P engine whose KV the decode step reads; None for a decode-only step."""
    return turn.prefill_url if turn.prefill_params else None


def _step_timeout(timeouts: Timeouts, total_s: float) -> Timeout:
    return Timeout(total=total_s, connect=timeouts.connect_s, pool=timeouts.pool_s)


def _blame_broken_stream(engine: Engine, error: BaseException | None) -> None:
    """A stream that ended before its end, went quiet or whose connection dropped makes its
    engine suspect; a bad answer or the router's own failure (``error``'s kind) does not."""
    if error is None:
        engine.mark_suspect()
    else:
        engine.record_failure(wire_kind(error))


def _unservable(turn: Turn) -> RouterError:
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


def _log_breakdown(turn: Turn) -> None:
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
