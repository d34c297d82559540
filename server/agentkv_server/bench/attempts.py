"""Every HTTP try of a turn as the client makes it: what a client that retries would hide.

openai's client retries a refusal (429, or a 5xx unless ``x-should-retry: false``), sleeping its
``Retry-After`` up to two minutes, and a timeout, up to ``max_retries`` times, all inside one
call: the turn's record alone would show a slow answer where the router refused it twice.
:class:`RecordingTransport` sits under the SDK and notes each try (status, error code,
``Retry-After``, seconds to the answer's headers, the router's queue wait) in the list of the
turn being sent in the current task (:func:`recording`): the tries of one turn are made in its
task, one after another.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Final

import httpx

from agentkv import protocol
from agentkv_server.bench.records import Attempt

__all__ = ["QUEUE_STEP", "RecordingTransport", "attempt_of", "recording"]

# The router's Server-Timing entry for a turn's wait in its queue (desc: the turn's priority).
QUEUE_STEP: Final = "queue"
_SHOULD_RETRY: Final = "x-should-retry"
_RETRY_AFTER: Final = "retry-after"

_tries: ContextVar[list[Attempt] | None] = ContextVar("agentkv_bench_tries", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Attempt]]:
    """The tries made in this task while the block runs, in order."""
    tries: list[Attempt] = []
    token = _tries.set(tries)
    try:
        yield tries
    finally:
        _tries.reset(token)


class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes every request to ``inner`` and notes the try where :func:`recording` listens.

    An error answer's body is read here (for its ``error.code``) and handed on as a fresh
    response with the same status, headers and bytes, so the client reads it as it would have.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        tries = _tries.get()
        started = time.perf_counter()
        try:
            response = await self._inner.handle_async_request(request)
        except Exception as exc:
            if tries is not None:
                error = f"{type(exc).__name__}: {exc}"[:200]
                tries.append(Attempt(None, time.perf_counter() - started, error=error))
            raise
        if tries is None:
            return response
        seconds = time.perf_counter() - started
        if response.status_code < 400:
            tries.append(attempt_of(response.status_code, response.headers, seconds))
            return response
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        tries.append(attempt_of(response.status_code, response.headers, seconds, _code(body)))
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=body,
            request=request,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def attempt_of(
    status: int, headers: Mapping[str, str], seconds: float, code: str | None = None
) -> Attempt:
    """A try from its answer's status and headers."""
    should_retry = headers.get(_SHOULD_RETRY)
    queue_s, priority = _queue(headers.get(protocol.HEADER_SERVER_TIMING) or "")
    return Attempt(
        status=status,
        seconds=seconds,
        code=code,
        retry_after_s=_seconds(headers.get(_RETRY_AFTER)),
        should_retry=None if should_retry is None else should_retry.strip().lower() == "true",
        queue_s=queue_s,
        queue_priority=priority,
    )


def _queue(server_timing: str) -> tuple[float | None, str | None]:
    for name, params in protocol.server_timing_entries(server_timing):
        if name == QUEUE_STEP:
            return _seconds(params.get("dur"), scale=1e-3), params.get("desc") or None
    return None, None


def _seconds(value: str | None, *, scale: float = 1.0) -> float | None:
    """A number of seconds (``Retry-After`` in its delta form; a date counts as absent)."""
    try:
        return float(value) * scale if value is not None else None
    except ValueError:
        return None


def _code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
