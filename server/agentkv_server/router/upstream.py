"""Turn steps' calls to engines, over the app's one :class:`HTTPClient`.

Every failure becomes an :class:`EngineFailure` with a kind (failures.py) the metrics count and
the orchestrator acts on (another engine, a recompute, or passing a 4xx back to the client).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from agentkv_server.router import codec
from agentkv_server.router.failures import STUCK, UNREACHABLE, ErrorKind, wire_kind
from agentkv_server.router.http_client import HTTPClient, HTTPError, HTTPResponse, Timeout
from agentkv_server.router.placement import Engine

__all__ = ["DecodeStream", "EngineFailure", "Silence", "open_stream", "post_json"]


class EngineFailure(Exception):
    """An engine step that did not produce a usable answer."""

    def __init__(
        self,
        engine: Engine,
        kind: ErrorKind,
        detail: str,
        *,
        status: int | None = None,
        body: bytes = b"",
        content_type: str = "application/json",
    ) -> None:
        super().__init__(f"{engine.role} engine {engine.url}: {kind}: {detail}")
        self.engine = engine
        self.kind = kind
        self.status = status
        self.body = body
        self.content_type = content_type

    @property
    def is_client_error(self) -> bool:
        """The engine refused the request itself (4xx): another engine would refuse it too."""
        return (
            self.status is not None and 400 <= self.status < 500 and self.status not in (408, 429)
        )

    @property
    def engine_unreachable(self) -> bool:
        return self.kind in UNREACHABLE

    @property
    def engine_stuck(self) -> bool:
        """The engine answered nothing in time, or made no progress."""
        return self.kind in STUCK


async def post_json(
    http: HTTPClient,
    engine: Engine,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    timeout: Timeout,
) -> dict[str, Any]:
    """POST ``body`` and return the engine's JSON object answer."""
    try:
        reply = await http.fetch(
            engine.url + path, timeout, json=codec.dumps(body), headers=headers
        )
    except (asyncio.TimeoutError, HTTPError) as exc:
        raise _wire_failure(engine, exc) from exc
    raw = reply.body
    _raise_for_status(engine, reply.status, reply.headers, raw)
    try:
        answer = codec.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineFailure(engine, "protocol", f"answer is not JSON: {exc}") from exc
    if not isinstance(answer, dict):
        raise EngineFailure(engine, "protocol", "answer is not a JSON object")
    return answer


@dataclasses.dataclass(frozen=True)
class Silence:
    """How a stream already passed on tells a frozen engine from a slow one."""

    unresponsive: Callable[[], Awaitable[bool]]
    """One health probe: True when it went unanswered."""
    after_s: float
    """Silence before the first probe."""
    probes: int
    """Probes unanswered in a row that end the stream."""


class DecodeStream:
    """An engine's streamed answer whose first chunk has already arrived.

    Waiting for the first chunk before answering the client is what lets the router retry a
    decode that fails early on another engine: nothing has been sent yet.

    With a :class:`Silence`, a stream silent for its ``after_s`` asks whether its engine still
    answers: a frozen engine keeps the connection open and says nothing, and waiting ``idle_s``
    for it would stall the client for a minute (docs/faults.md). ``probes`` unanswered in a row
    end the stream as a timeout, in seconds; an engine that answers is waited for up to
    ``idle_s`` of silence (a busy core, a long prefill in its batch).
    """

    def __init__(
        self, response: HTTPResponse, first: bytes, idle_s: float, silence: Silence | None = None
    ) -> None:
        self._response = response
        self._first = first
        self._idle_s = idle_s
        self._silence = silence
        self.content_type = response.headers.get("content-type", "text/event-stream")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The chunks; asyncio.TimeoutError when none comes for ``idle_s``, or sooner when the
        engine leaves its health probes unanswered (a stuck engine)."""
        yield self._first
        while chunk := await self._next_chunk():
            yield chunk

    async def _next_chunk(self) -> bytes:
        silence = self._silence
        if silence is None:
            return await self._response.readany(self._idle_s)
        loop = asyncio.get_running_loop()
        silent_until = loop.time() + self._idle_s
        wait, unanswered = silence.after_s, 0
        while True:
            try:
                return await self._response.readany(min(wait, max(silent_until - loop.time(), 0)))
            except asyncio.TimeoutError:
                if loop.time() >= silent_until:
                    raise
            if await silence.unresponsive():
                unanswered += 1
                if unanswered >= silence.probes:
                    raise asyncio.TimeoutError(
                        f"no chunk, and {unanswered} health probes in a row unanswered"
                    )
                wait = 0.0  # probe again at once, unless a chunk came meanwhile
            else:
                unanswered, wait = 0, silence.after_s

    def close(self) -> None:
        self._response.release()


async def open_stream(
    http: HTTPClient,
    engine: Engine,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    timeout: Timeout,
    first_chunk_s: float,
    idle_s: float,
    silence: Silence | None = None,
) -> DecodeStream:
    """POST a streaming request and wait for its first chunk, at most ``first_chunk_s`` from
    the request's start (its wait for a connection included); later chunks may be at most
    ``idle_s`` apart, less on an engine that ``silence`` finds frozen (:class:`DecodeStream`)."""
    loop = asyncio.get_running_loop()
    first_by = loop.time() + first_chunk_s
    late = f"no first chunk within {first_chunk_s:g}s"
    try:
        response = await http.post(
            engine.url + path,
            codec.dumps(body),
            headers,
            dataclasses.replace(timeout, head=first_chunk_s),
        )
    except (asyncio.TimeoutError, HTTPError) as exc:
        raise _wire_failure(engine, exc, late) from exc
    try:
        if response.status != 200:
            raw = await _read_by(response, first_by)
            _raise_for_status(engine, response.status, response.headers, raw)
        first = await response.readany(max(first_by - loop.time(), 0.0))
    except (asyncio.TimeoutError, HTTPError) as exc:
        response.release()
        raise _wire_failure(engine, exc, late) from exc
    except BaseException:
        response.release()
        raise
    if not first:
        response.release()
        raise EngineFailure(engine, "stream", "stream ended before its first chunk")
    return DecodeStream(response, first, idle_s, silence)


async def _read_by(response: HTTPResponse, by: float) -> bytes:
    """The whole body, by the loop time ``by`` (else asyncio.TimeoutError)."""
    loop = asyncio.get_running_loop()
    parts = []
    while part := await response.readany(max(by - loop.time(), 0.0)):
        parts.append(part)
    return b"".join(parts)


def _raise_for_status(engine: Engine, status: int, headers: Mapping[str, str], raw: bytes) -> None:
    if status == 200:
        return
    raise EngineFailure(
        engine,
        "status",
        f"HTTP {status}: {raw[:200]!r}",
        status=status,
        body=raw,
        content_type=headers.get("content-type", "application/json"),
    )


def _wire_failure(engine: Engine, exc: BaseException, late: str = "") -> EngineFailure:
    """What a call that failed on the wire means (failures.py): whose failure, and its kind."""
    kind = wire_kind(exc)
    detail = str(exc) or (late if kind == "timeout" and late else type(exc).__name__)
    return EngineFailure(engine, kind, detail)
