"""An engine's queue as the router sees it: the steps in flight on the engine, and the turns the
router holds back for it.

A prefill engine's steps range from a pull's few hundred new tokens to a cold first turn's whole
history, so a count of steps in flight times their mean time says little: on the pressure preset
a follow-up's pull waited 13.8 s behind cold first turns where that estimate saw a few seconds
(docs/router.md, "P's queue"). :class:`StepQueue` therefore keeps each step's tokens and fits how
long the engine takes to serve a step against them.

vLLM serves its queue first come, first served, so a follow-up whose history is held (cheap, its
agent waiting) sent behind a burst of new sessions' cold turns waits for all of them. The router
sends an engine new work only while what it has is predicted to end within ``hold_beyond_s``, and
holds the rest (:meth:`StepQueue.send`). A follow-up counts only the follow-ups in flight: the
new sessions' prompts sent before it are computed a slice at a time beside it (the prefill
engines' step size, AdmissionSettings.prefill_step_tokens). Held turns go by :class:`Priority`
(follow-ups first),
and within a priority by start-time fair queuing between tenants, each turn weighted by its
predicted service, so that one tenant's burst does not stall another's sessions
(docs/router.md, "Admission").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from agentkv_server.router.fit import LinearFit

__all__ = ["Priority", "QueuedStep", "StepQueue"]

# Weight of each served step in StepQueue's fit: the last ten or so steps.
_SERVICE_ALPHA = 0.1
# A held turn's weight in fair queuing is never below this (seconds): ordering must advance.
_MIN_COST_S = 1e-3
# Shortest wait between two looks at a queue whose work is predicted to end soon.
_MIN_RECHECK_S = 0.05
# After every held turn of the same priority and start tag (ties go first come, first served).
_LAST = float("inf")
# How far back the follow-ups' share of an engine is measured, and the most it is taken to be
# (past it, a new turn's wait is predicted as 1 / (1 - 0.9) = 10 times the queue ahead of it).
_SHARE_WINDOW_S = 60.0
_MAX_SHARE = 0.9


class Priority(enum.IntEnum):
    """Which held turns go first (lower first). Its name is the ``priority`` label of the
    admission metrics and the ``desc`` of the ``queue`` entry of ``Server-Timing``."""

    FOLLOW_UP = 0
    """A turn of a session that has run before: its agent is waiting, its history often held."""
    NEW = 1
    """A new session's first turn, or a turn without a session."""

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(eq=False, slots=True)
class QueuedStep:
    """A step on an engine: when it was sent, the tokens it was expected to compute, its
    priority, and how long the router held it back before that."""

    sent_at: float
    tokens: int
    priority: Priority = Priority.NEW
    waited_s: float = 0.0


@dataclass(eq=False)
class _Held:
    """A turn the router holds back for the engine."""

    priority: Priority
    start: float
    """Its start tag in its priority's fair queue (virtual seconds)."""
    order: int
    tokens: int
    cost_s: float
    arrived: float
    sent: asyncio.Future[QueuedStep] = field(default_factory=asyncio.Future)

    def key(self) -> tuple[int, float, float]:
        return (self.priority, self.start, self.order)


class StepQueue:
    """The steps in flight on an engine, each with the tokens it computes, how long the engine
    takes to serve a step against those tokens, and the turns the router holds back for it.

    ``hold_beyond_s`` None: nothing is held back (decode engines, or admission off).
    ``prior_s_per_token``: what a step is predicted to take until one was served.
    """

    def __init__(
        self,
        *,
        hold_beyond_s: float | None = None,
        prior_s_per_token: Callable[[], float] | None = None,
    ) -> None:
        self._fit: LinearFit | None = None
        self._in_flight: dict[QueuedStep, None] = {}  # in the order they were sent
        self._tokens_in_flight = 0
        self._last_end: float | None = None
        self._queued_at_last_end = False
        self._hold_beyond_s = hold_beyond_s
        self._prior = prior_s_per_token
        self._held: list[_Held] = []
        self._order = itertools.count()
        self._virtual: dict[Priority, float] = {}  # each priority's virtual time
        self._finish: dict[tuple[Priority, str | None], float] = {}  # a tenant's last finish tag
        self._recheck: asyncio.TimerHandle | None = None
        # Follow-ups sent lately, with their predicted service: the share of the engine they
        # take, which every later follow-up takes ahead of a held new turn.
        self._follow_ups: deque[tuple[float, float]] = deque()

    # -- in flight ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[QueuedStep]:
        """Count a step of about ``tokens`` computed tokens in flight for the block, now."""
        step = self._send(tokens)
        try:
            yield step
        finally:
            self.ended(step)

    def served(self, step: QueuedStep, tokens: int | None = None) -> float:
        """``step`` ended with its answer, having computed ``tokens`` (None: as estimated);
        returns its service seconds.

        Where other steps were in flight when the previous one ended, the engine was busy in
        between, and the time since is this step's service (its own time includes its wait).
        """
        now = time.monotonic()
        seconds = now - step.sent_at
        if self._last_end is not None and self._queued_at_last_end:
            seconds = min(seconds, now - self._last_end)
        tokens = step.tokens if tokens is None else tokens
        if self._fit is None:  # anchored at nothing to compute, nothing to serve
            self._fit = LinearFit(0.0, seconds / max(tokens, 1), _SERVICE_ALPHA)
        self._fit.add(tokens, seconds)
        self._last_end, self._queued_at_last_end = now, len(self._in_flight) > 1
        return seconds

    def service_s(self, tokens: int) -> float | None:
        """Seconds a step of ``tokens`` computed tokens takes to serve; None until one was."""
        if self._fit is None:
            return None
        intercept, slope = self._fit.line()
        return intercept + slope * tokens

    def backlog_s(self) -> float:
        """The service the steps in flight still need (0 until one step was served): theirs
        summed, less what the oldest has had since it was sent or the last step ended."""
        if self._fit is None:
            return 0.0
        return self._pending_s()

    def follow_up_backlog_s(self) -> float:
        """What a follow-up sent now waits for, as :meth:`backlog_s` prices it: the follow-ups
        in flight and held (new sessions' prompts in flight are computed beside it)."""
        in_flight = 0.0 if self._fit is None else self._pending_s(Priority.FOLLOW_UP)
        return in_flight + self.held_s(Priority.FOLLOW_UP)

    @property
    def turns_sharing(self) -> int:
        """The turns a step sent now would delay: those in flight (computed beside it) and
        those held (sent after it)."""
        return len(self._in_flight) + len(self._held)

    @property
    def tokens_in_flight(self) -> int:
        return self._tokens_in_flight

    # -- held back ---------------------------------------------------------------------------

    async def send(
        self, tokens: int, priority: Priority, tenant: str | None, timeout_s: float | None = None
    ) -> QueuedStep:
        """A step of about ``tokens`` computed tokens, counted in flight (until :meth:`ended`)
        once the engine has room and no turn before it in the router's order is held.
        ``asyncio.TimeoutError`` when not sent within ``timeout_s``; cancelled or timed out, the
        turn leaves the queue."""
        if self._hold_beyond_s is None or (not self._held and self._has_room(priority)):
            return self._send(tokens, priority)
        held = self._hold(tokens, priority, tenant)
        try:
            return await asyncio.wait_for(held.sent, timeout_s)
        except BaseException:
            self._drop(held)
            raise

    def ended(self, step: QueuedStep) -> None:
        """``step`` is no longer in flight (answered or failed): room for the next."""
        if self._in_flight.pop(step, False) is False:
            return
        self._tokens_in_flight -= step.tokens
        if self._held:
            self._dispatch()

    def wait_s(self, tokens: int, priority: Priority, tenant: str | None) -> float:
        """Predicted seconds before the engine starts a step of ``tokens`` sent now as a turn
        of ``priority`` and ``tenant``: the work in flight and the held turns that go first;
        for a new session's turn, stretched by the follow-ups that will arrive meanwhile and go
        first too (the engine's share they took lately, ``rho``: wait / (1 - rho))."""
        start = self._start_tag(priority, tenant)
        ahead = sum(held.cost_s for held in self._held if held.key() < (priority, start, _LAST))
        wait = self._pending_s(priority) + ahead
        if priority is Priority.FOLLOW_UP:
            return wait
        return wait / (1.0 - self.follow_up_share())

    def follow_up_share(self) -> float:
        """The share of the engine's time follow-ups took over the last ``_SHARE_WINDOW_S``
        (their predicted service), at most ``_MAX_SHARE``."""
        horizon = time.monotonic() - _SHARE_WINDOW_S
        recent = self._follow_ups
        while recent and recent[0][0] < horizon:
            recent.popleft()
        return min(sum(cost for _, cost in recent) / _SHARE_WINDOW_S, _MAX_SHARE)

    def held_s(self, up_to: Priority = Priority.NEW) -> float:
        """The predicted service of the turns held back for the engine, of ``up_to`` or a
        higher priority."""
        return sum(held.cost_s for held in self._held if held.priority <= up_to)

    def held_count(self, priority: Priority) -> int:
        return sum(1 for held in self._held if held.priority is priority)

    def _hold(self, tokens: int, priority: Priority, tenant: str | None) -> _Held:
        cost_s = max(self._predicted_s(tokens), _MIN_COST_S)
        start = self._start_tag(priority, tenant)
        self._finish[(priority, tenant)] = start + cost_s
        held = _Held(priority, start, next(self._order), tokens, cost_s, time.monotonic())
        self._held.append(held)
        self._dispatch()
        return held

    def _start_tag(self, priority: Priority, tenant: str | None) -> float:
        """Start-time fair queuing: a turn starts at its priority's virtual time, or where its
        tenant's previous held turn finishes, whichever is later."""
        virtual = self._virtual.get(priority, 0.0)
        return max(virtual, self._finish.get((priority, tenant), virtual))

    def _drop(self, held: _Held) -> None:
        """A held turn's caller gave up (a deadline, a client gone): out of the queue, and out
        of flight if it was sent meanwhile."""
        if held in self._held:
            self._held.remove(held)
        elif held.sent.done() and not held.sent.cancelled():
            self.ended(held.sent.result())
        self._dispatch()

    def _dispatch(self) -> None:
        """Send held turns, best first, while the engine has room; look again when its work in
        flight is predicted to leave room."""
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        while self._held:
            held = min(self._held, key=_Held.key)
            if not self._has_room(held.priority):
                break
            self._held.remove(held)
            self._virtual[held.priority] = held.start
            step = self._send(held.tokens, held.priority)
            step.waited_s = step.sent_at - held.arrived
            if not held.sent.done():
                held.sent.set_result(step)
            else:  # its caller is gone already
                self.ended(step)
        if not self._held:
            self._finish.clear()  # no turn to be fair to: every tenant starts afresh
            self._virtual.clear()
            return
        delay = self._room_in_s(min(self._held, key=_Held.key).priority)
        if delay is not None:
            loop = asyncio.get_running_loop()
            self._recheck = loop.call_later(max(delay, _MIN_RECHECK_S), self._dispatch)

    def _has_room(self, priority: Priority) -> bool:
        """Whether a step of ``priority`` may be sent now: the work in flight that it would
        wait for (a follow-up: other follow-ups only) ends within ``hold_beyond_s``. A
        follow-up does not wait for the new sessions' prompts in flight: the engine computes
        those a slice at a time beside it (AdmissionSettings.prefill_step_tokens)."""
        assert self._hold_beyond_s is not None
        return self._pending_s(priority) <= self._hold_beyond_s

    def _room_in_s(self, priority: Priority) -> float | None:
        """Seconds until the work in flight is predicted to leave room for a step of
        ``priority``; None when only a step's end can (the oldest is past its predicted
        service)."""
        assert self._hold_beyond_s is not None
        total, oldest, served = self._work(priority)
        if not total:
            return None
        excess = total - served - self._hold_beyond_s
        return excess if excess <= oldest - served else None

    # -- shared ------------------------------------------------------------------------------

    def _send(self, tokens: int, priority: Priority = Priority.NEW) -> QueuedStep:
        step = QueuedStep(time.monotonic(), tokens, priority)
        self._in_flight[step] = None
        self._tokens_in_flight += tokens
        if priority is Priority.FOLLOW_UP:
            self._follow_ups.append((step.sent_at, self._predicted_s(tokens)))
        return step

    def _predicted_s(self, tokens: int) -> float:
        """A step's service: as fitted, else at the prior rate (0 without one)."""
        intercept, slope = self._line()
        return intercept + slope * tokens

    def _line(self) -> tuple[float, float]:
        if self._fit is not None:
            return self._fit.line()
        return 0.0, self._prior() if self._prior is not None else 0.0

    def _pending_s(self, up_to: Priority = Priority.NEW) -> float:
        """The service the steps in flight of ``up_to`` or a higher priority still need, at the
        prior rate until one was served."""
        total, _, served = self._work(up_to)
        return total - served

    def _work(self, up_to: Priority = Priority.NEW) -> tuple[float, float, float]:
        """The predicted service of the steps in flight (of ``up_to`` or a higher priority)
        together and of the oldest of them, and what that one has had of its own since it
        was sent or the last step ended."""
        steps = self._in_flight if up_to is Priority.NEW else self._of(up_to)
        if not steps:
            return 0.0, 0.0, 0.0
        intercept, slope = self._line()
        tokens = self._tokens_in_flight if up_to is Priority.NEW else sum(s.tokens for s in steps)
        total = intercept * len(steps) + slope * tokens
        first = next(iter(steps))
        oldest = intercept + slope * first.tokens
        began = first.sent_at if self._last_end is None else max(first.sent_at, self._last_end)
        return total, oldest, min(max(time.monotonic() - began, 0.0), oldest)

    def _of(self, up_to: Priority) -> list[QueuedStep]:
        return [step for step in self._in_flight if step.priority <= up_to]
