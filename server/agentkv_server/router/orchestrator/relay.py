"""A decode stream passed on to the client, continued elsewhere when its engine breaks.

Bytes already went out, so a stream that breaks is not retried but continued: another decode
engine computes prompt plus answer so far and generates the rest (resume.py). The stream's end
is held back until the turn's holding is recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from agentkv_server.router.failures import wire_kind
from agentkv_server.router.formats import StreamEditor
from agentkv_server.router.http_client import HTTPError
from agentkv_server.router.orchestrator.accounting import log_breakdown
from agentkv_server.router.orchestrator.attempts import Attempt, Then, attempt
from agentkv_server.router.orchestrator.plan import Plan
from agentkv_server.router.orchestrator.services import Services
from agentkv_server.router.placement import Engine
from agentkv_server.router.resume import ResumableStream, continuation_body
from agentkv_server.router.turn import Turn
from agentkv_server.router.upstream import DecodeStream, EngineFailure

__all__ = ["Relay", "Relayed"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Relayed:
    """The decode stream being passed on, its engine and its holding's ticket."""

    stream: DecodeStream
    engine: Engine
    ticket: str | None


class Relay:
    """One turn's streamed answer on its way to the client."""

    __slots__ = ("_editor", "_plan", "_services", "_source", "_turn")

    def __init__(
        self,
        services: Services,
        turn: Turn,
        plan: Plan,
        editor: StreamEditor,
        source: str | None,
    ) -> None:
        self._services = services
        self._turn = turn
        self._plan = plan
        self._editor = editor
        self._source = source  # the P engine whose KV the first stream's engine read

    async def chunks(self, relayed: Relayed) -> AsyncGenerator[bytes, None]:
        """Pass the stream on; one that breaks is continued elsewhere when it can be."""
        editor = self._editor
        resumes = 0
        try:
            while True:
                broke, error = None, None
                try:
                    async for part in self._pass_on(relayed):
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
                self._services.metrics.record_engine_error("decode", "stream")
                _blame_broken_stream(relayed.engine, error)
                if not isinstance(editor, ResumableStream):
                    return
                if resumes >= self._services.settings.faults.stream_resumes:
                    logger.warning("stream not continued: %d continuations already", resumes)
                    return
                resumes += 1
                resumed = await self._resume(relayed, editor)
                if isinstance(resumed, bytes):
                    yield resumed
                if not isinstance(resumed, Relayed):
                    return
                relayed = resumed
        finally:
            log_breakdown(self._turn)

    async def _pass_on(self, relayed: Relayed) -> AsyncIterator[bytes]:
        editor = self._editor
        engine = relayed.engine
        steps, last = engine.steps, None
        async for chunk in relayed.stream.chunks():
            now = time.monotonic()
            if last is not None:  # the first chunk came before the relay
                steps.observe(now - last)
            # An engine whose streams flow is not frozen: no health probe before its next step.
            engine.answered_at = last = now
            head, final = editor.feed(chunk)
            if head:
                yield head
            if final is None:
                continue
            params = editor.kv_transfer_params
            self._services.record_returned(self._source, relayed.engine, relayed.ticket, params)
            if relayed.ticket is not None:
                waited = time.monotonic()
                await self._hold_back_final(relayed.ticket, params)
                self._turn.phases["report"] = time.monotonic() - waited
            yield final
        if rest := editor.flush():
            yield rest

    async def _resume(self, broken: Relayed, editor: ResumableStream) -> Relayed | bytes | None:
        """The broken stream's continuation on another decode engine (decode-only: it
        recomputes prompt + answer so far); the stream's end when the answer was complete;
        None when it cannot be continued."""
        progress = editor.progress()
        if broken.ticket is not None:  # the dead engine's holding must not become the session's
            await self._services.keeper.void(broken.ticket)
        request = self._turn.request.body
        if (blocker := progress.blocker_for(request)) is not None:
            logger.warning("stream not continued: %s", blocker)
            return None
        body = continuation_body(request, progress)
        if body is None:
            return editor.finish()
        resumed = await attempt(
            ResumeAttempt(self._services, self._turn, self._plan, body),
            tries=self._services.settings.decode_attempts,
            excluded=[broken.engine],
        )
        if not isinstance(resumed, Relayed):
            logger.warning("stream not continued: no decode engine could take it over")
            return None
        logger.warning(
            "stream continued on %s after %d tokens", resumed.engine.url, progress.sent_tokens
        )
        self._services.metrics.record_stream_resumed()
        editor.continue_stream()
        return resumed

    async def _hold_back_final(self, ticket: str, params: dict[str, Any] | None) -> None:
        """The stream's end tells the client it may send its next turn: hold it back until this
        turn's holding is recorded (from the stream itself or D's report), or that turn would
        recompute."""
        keeper = self._services.keeper
        if params is not None:
            await keeper.record(ticket, params)
        elif not self._services.policy.sends_hints:
            return  # engines sent no ticket never report: waiting would only delay the end
        await keeper.wait_recorded(ticket, self._services.settings.timeouts.report_s)


class ResumeAttempt(Attempt[Relayed]):
    """A broken stream's ``continuation`` on a decode engine of its own: no P, no pair."""

    __slots__ = ("_continuation", "_retention_s")

    def __init__(
        self, services: Services, turn: Turn, plan: Plan, continuation: dict[str, Any]
    ) -> None:
        super().__init__(services, turn)
        self._continuation = continuation
        self._retention_s = services.kept_s(plan.retention_s)

    def pick(self, excluded: Sequence[Engine]) -> Engine | None:
        return self.services.decode.pick(exclude=excluded)

    async def send(self, engine: Engine) -> Relayed:
        services = self.services
        body, ticket, releases = await services.decode_request(
            self.turn, engine, self._continuation, None, self._retention_s
        )
        # The client has had its first token: the continuation is due within a turn's bound
        # from now, not by the turn's first-token deadline.
        first_chunk_s = services.settings.timeouts.first_token_s
        with services.keeper.released_if_failed(releases):
            stream = await services.open_stream(
                self.turn, engine, body, first_chunk_s=first_chunk_s
            )
        return Relayed(stream, engine, ticket)

    def then(self, failure: EngineFailure) -> Then:
        return Then.REFUSED if failure.is_client_error else Then.ELSEWHERE


def _blame_broken_stream(engine: Engine, error: BaseException | None) -> None:
    """A stream that ended before its end, went quiet or whose connection dropped makes its
    engine suspect; a bad answer or the router's own failure (``error``'s kind) does not."""
    if error is None:
        engine.mark_suspect("stream")
    else:
        engine.record_failure(wire_kind(error))
