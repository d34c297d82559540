"""Backoff for an engine loop that only waits.

vLLM's engine core steps without pause while any request is unfinished or still holds blocks
for a connector, and each empty step runs the model executor. A decode engine that retains a
session's KV for the next turn, or a prefill engine waiting on a pull, therefore keeps about a
core busy doing nothing (measured in docs/connector.md); on a CPU machine that core is one the
other engines need. Once the engine has had nothing to compute for ``grace_seconds``, each
further empty step sleeps ``sleep_seconds``: work that arrives meanwhile waits at most that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["IdleBackoff"]


class IdleBackoff:
    """Call ``step(busy)`` once per engine step; it sleeps when the engine has idled long."""

    def __init__(
        self,
        *,
        grace_seconds: float,
        sleep_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._grace = grace_seconds
        self._sleep_seconds = sleep_seconds
        self._clock = clock
        self._sleep = sleep
        self._idle_since: float | None = None

    def step(self, *, busy: bool) -> float:
        """Note one step; returns the seconds slept (0 unless idle past the grace period)."""
        if busy or self._sleep_seconds <= 0:
            self._idle_since = None
            return 0.0
        now = self._clock()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self._grace:
            return 0.0
        self._sleep(self._sleep_seconds)
        return self._sleep_seconds
