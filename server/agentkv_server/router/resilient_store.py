"""A session store that fails soft: when the index (Redis) is unreachable, turns recompute.

The index only saves work; losing it must never fail a client's turn. Every call runs under a
timeout, and a failure makes the router go on without the store for ``retry_after_s`` (no turn
waits on a dead Redis meanwhile), then try it again. While it is out, each operation answers
what "nothing is held" means: ``take`` finds nothing (recompute), ``offer`` refuses the holding
(so the keeper releases its KV), tickets are neither issued nor found. The transitions are
logged as warnings and exported as ``agentkv_store_up`` and ``agentkv_store_errors_total{op}``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import RedisError

from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.sessions import Clock, Holding, InMemoryStore, SessionStore, Ticket

__all__ = ["ResilientStore"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Unreachable, timing out, or answering garbage (a value that no longer parses).
_FAILURES = (RedisError, OSError, asyncio.TimeoutError, ValueError, TypeError)


if sys.version_info >= (3, 11):

    async def _within(seconds: float, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` under a timeout, in the caller's task (wait_for makes a task per call)."""
        async with asyncio.timeout(seconds):
            return await call()

else:  # pragma: no cover - Python 3.10

    async def _within(seconds: float, call: Callable[[], Awaitable[T]]) -> T:
        return await asyncio.wait_for(call(), seconds)


class ResilientStore:
    """Wraps a :class:`SessionStore`; same operations, never raises for the store's failures."""

    def __init__(
        self,
        store: SessionStore,
        *,
        metrics: RouterMetrics,
        timeout_s: float,
        retry_after_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self.inner = store
        # A store whose operations never wait (one process's memory) needs no timeout: arming
        # one per call was ~3% of the router's CPU per session turn.
        self._bounded = not isinstance(store, InMemoryStore)
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._down_until: float | None = None
        metrics.store_up.set(1)

    @property
    def available(self) -> bool:
        """False while the router goes on without the store after a failure."""
        return self._down_until is None or self._clock() >= self._down_until

    async def take(self, session_key: str) -> Holding | None:
        return await self._call("take", lambda: self.inner.take(session_key), None)

    async def offer(self, holding: Holding) -> list[Holding]:
        return await self._call("offer", lambda: self.inner.offer(holding), [holding])

    async def end(self, session_key: str, at: float) -> Holding | None:
        return await self._call("end", lambda: self.inner.end(session_key, at), None)

    async def add_ticket(self, ticket: Ticket) -> None:
        await self._call("add_ticket", lambda: self.inner.add_ticket(ticket), None)

    async def pop_ticket(self, ticket_id: str) -> Ticket | None:
        return await self._call("pop_ticket", lambda: self.inner.pop_ticket(ticket_id), None)

    async def announce_recorded(self, ticket_id: str) -> None:
        await self._call("announce", lambda: self.inner.announce_recorded(ticket_id), None)

    async def watch_recorded(self, on_recorded: Callable[[str], None]) -> None:
        """The inner store's watch, started again ``retry_after_s`` after each failure."""
        while True:
            try:
                await self.inner.watch_recorded(on_recorded)
                return
            except _FAILURES as exc:
                logger.debug(
                    "watching recorded tickets failed (%r): again in %.0f s",
                    exc,
                    self._retry_after_s,
                )
            await asyncio.sleep(self._retry_after_s)

    async def count(self) -> int:
        return await self._call("count", self.inner.count, 0)

    async def close(self) -> None:
        await self._call("close", self.inner.close, None)

    async def _call(self, op: str, call: Callable[[], Awaitable[T]], fallback: T) -> T:
        if not self.available:
            return fallback
        try:
            result = await (_within(self._timeout_s, call) if self._bounded else call())
        except _FAILURES as exc:
            self._fail(op, exc)
            return fallback
        if self._down_until is not None:
            self._down_until = None
            self._metrics.store_up.set(1)
            logger.warning("session store is back: reuse resumes")
        return result

    def _fail(self, op: str, exc: BaseException) -> None:
        self._metrics.store_errors.labels(op=op).inc()
        if self._down_until is None:
            logger.warning(
                "session store failed (%s: %r): serving without it (every turn recomputes), "
                "retrying every %.0f s",
                op,
                exc,
                self._retry_after_s,
            )
        self._metrics.store_up.set(0)
        self._down_until = self._clock() + self._retry_after_s
