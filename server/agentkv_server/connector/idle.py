"""Backoff for an engine loop that only waits.

vLLM's engine core steps without pause while any request is unfinished or still holds blocks
for a connector, and each empty step is an RPC to the worker process, whose shared-memory
reader then busy-waits (``sched_yield``) for a second for the next one. A decode engine that
retains a session's KV for the next turn therefore keeps a core busy doing nothing (measured
in docs/connector.md). Once the engine has had nothing to compute for ``grace_seconds``, each
further empty step waits: ``sleep_seconds`` at first, four times longer each time, up to
``max_wait_seconds`` (within ~7 s of 5 ms): every step costs the worker a second of spinning,
so few steps matter more than when they come.

A wait that long is only safe if new work ends it: ``engine_input_queue`` finds the queue
the engine core reads requests from, and ``wait_for_input`` returns as soon as anything is
put on it. Without that queue the wait stays at ``sleep_seconds``.
"""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["IdleBackoff", "engine_input_queue", "wait_for_input"]

_GROWTH = 4


class IdleBackoff:
    """Call ``step(busy)`` once per engine step; it waits when the engine has idled long."""

    def __init__(
        self,
        *,
        grace_seconds: float,
        sleep_seconds: float,
        max_wait_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._grace = grace_seconds
        self._sleep_seconds = sleep_seconds
        self._max_wait = max(sleep_seconds, max_wait_seconds or sleep_seconds)
        self._clock = clock
        self._sleep = sleep
        self._idle_since: float | None = None
        self._next_wait = sleep_seconds

    def step(self, *, busy: bool) -> float:
        """Note one step; returns the seconds waited (0 unless idle past the grace period)."""
        if busy or self._sleep_seconds <= 0:
            self._idle_since = None
            self._next_wait = self._sleep_seconds
            return 0.0
        now = self._clock()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self._grace:
            return 0.0
        wait = self._next_wait
        self._next_wait = min(_GROWTH * wait, self._max_wait)
        self._sleep(wait)
        return wait


def engine_input_queue() -> queue.Queue[Any] | None:
    """The request queue of the engine core that is constructing the caller, if any.

    vLLM gives a connector no handle on its engine core, but builds the scheduler (and so the
    connector) inside ``EngineCoreProc.__init__`` after creating ``self.input_queue``; the
    queue is found once, among the callers' frames. None where the engine runs in-process
    without one.
    """
    frame = sys._getframe(1)
    while frame is not None:
        candidate = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(candidate, queue.Queue):
            return candidate
        frame = frame.f_back
    return None


def wait_for_input(requests: queue.Queue[Any], seconds: float) -> None:
    """Block up to ``seconds``, returning early once ``requests`` holds anything."""
    with requests.not_empty:  # the queue's own condition: ``put`` notifies it
        requests.not_empty.wait_for(lambda: len(requests.queue) > 0, timeout=seconds)
