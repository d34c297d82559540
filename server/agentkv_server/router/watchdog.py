"""Dead and hung engines, found in seconds (docs/faults.md).

Two checks, both bounded by the router's own deadlines, never by an engine's:

- :meth:`Watchdog.unanswered`, before a pull is planned: the holder answered within
  ``liveness_cache_s``, or answers ``GET /health`` within ``liveness_timeout_s``. A holder that
  cannot answer would leave P's pull waiting on it; the turn recomputes instead.
- :meth:`Watchdog.run`, around an engine step. An engine not heard from within
  ``liveness_cache_s`` is asked ``GET /health`` as the step starts, beside it (the step does not
  wait for it): ``unanswered_probes`` probes in a row each unanswered within
  ``liveness_timeout_s`` is a ``hang``, found in about a second rather than after the progress
  reads below. Then every ``progress_every_s`` it reads the engine's token counters
  (``GET /metrics``). No answer ``unanswered_probes`` times in a row (frozen or dead) is a
  ``hang``; counters flat for ``stall_s`` (the engine answers but its core makes no progress)
  is a ``stall``. Either way the step's connection is closed, which aborts the
  request in vLLM, and the caller serves the turn elsewhere.
- :meth:`Watchdog.unresponsive`, for a stream already passed on: silent for ``progress_every_s``,
  it asks ``GET /health``; ``unanswered_probes`` unanswered in a row end the stream, which is
  then continued on another engine (relay.py). A non-streamed answer gives no
  sign of life until it is complete, hence reading progress beside it. A read the router
  itself could not make (no free connection) counts neither way.

The step runs in the caller's task. A watcher task starts only for a step on an engine not
heard from lately, or one still running ``progress_every_s`` after it began (one timer for all
steps finds those): most steps are neither, and cost a dict entry rather than a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable
from typing import TypeVar

from agentkv_server.router.failures import ErrorKind
from agentkv_server.router.http_client import HTTPClient, HTTPError, HTTPLocalError, Timeout
from agentkv_server.router.placement import Engine, probe_health
from agentkv_server.router.upstream import EngineFailure
from agentkv_server.settings import FaultSettings

__all__ = ["PROGRESS_SERIES", "Watchdog", "progress_of"]

T = TypeVar("T")

PROGRESS_SERIES = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
"""What moves while an engine computes (``GET /metrics``, Prometheus text). The token counters
move when a prompt's prefill ends and with each generated token; the gauges with every engine
step, since vLLM publishes its scheduler's state after each: a long prompt computed in chunks
grows the KV cache usage chunk by chunk while the counters stay flat (a 64k-token prompt of the
tiny-long model: flat counters for two minutes, usage up 0.8 % every second; docs/faults.md,
"Busy is not dead")."""


class _NotAsked:
    """A progress read the router could not make (its own failure)."""


NOT_ASKED = _NotAsked()

Progress = tuple[float, ...]
"""One progress read: the values of :data:`PROGRESS_SERIES`; any change is progress."""
Reading = Progress | None | _NotAsked


class Watchdog:
    """Liveness before a pull, progress while a step runs."""

    def __init__(self, http: HTTPClient, settings: FaultSettings, probe_timeout_s: float) -> None:
        self._http = http
        self._settings = settings
        self._liveness_timeout = Timeout(total=settings.liveness_timeout_s)
        self._probe_timeout = Timeout(total=probe_timeout_s)
        # One progress read per engine serves every step watched on it at the time.
        self._reads: dict[Engine, tuple[float, asyncio.Future[Reading]]] = {}
        # Steps not watched yet, by start (loop time; oldest first), and the one timer that
        # starts their watchers when they are still running ``progress_every_s`` later.
        self._unwatched: dict[_StepWatch, float] = {}
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def unanswered(self, engine: Engine) -> ErrorKind | None:
        """None when ``engine`` answers now; else why not, and it is marked suspect (or lost),
        unless the router could not ask (``router``)."""
        if engine.answered_within(self._settings.liveness_cache_s):
            return None
        problem = await probe_health(self._http, engine, self._liveness_timeout)
        if problem is not None and problem != "router":
            engine.mark_suspect(problem)
        return problem

    async def unresponsive(self, engine: Engine) -> bool:
        """Whether ``engine`` leaves a health probe unanswered within ``liveness_timeout_s``
        (frozen); asked by a stream that went silent (upstream.DecodeStream)."""
        return await probe_health(self._http, engine, self._liveness_timeout) == "timeout"

    async def run(
        self,
        engine: Engine,
        step: Awaitable[T],
        *,
        stall_s: float | None = None,
        probe_first: bool = True,
    ) -> T:
        """``step``'s result, or EngineFailure ``hang``/``stall`` once it stops progressing
        (its engine's counters flat for ``stall_s``, default ``faults.stall_s``).

        The step runs in the caller's task; a watcher task exists only while a step is slow or
        its engine was not heard from lately (most steps end before either), and aborts the
        step by cancelling the caller. ``probe_first`` False: no health probes as the step
        starts, only the progress reads (an engine retried after answering them late)."""
        watch = _StepWatch(self, engine, stall_s or self._settings.stall_s)
        if not probe_first or engine.answered_within(self._settings.liveness_cache_s):
            self._watch_later(watch)
        else:
            watch.start(waited=False)
        try:
            result = await step
        except BaseException:
            failure = watch.failure
            if failure is None or watch.cancelled_from_outside():
                raise
            raise failure from None
        finally:
            if self._unwatched.pop(watch, None) is None:
                watch.end()
        engine.mark_answered()
        return result

    def _watch_later(self, watch: _StepWatch) -> None:
        """Start ``watch``'s watcher if its step still runs ``progress_every_s`` from now."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests): the old one's timer is gone
            self._loop, self._sweep_timer = loop, None
            self._unwatched.clear()
        now = loop.time()
        self._unwatched[watch] = now
        if self._sweep_timer is None:
            self._sweep_timer = loop.call_at(now + self._settings.progress_every_s, self._sweep)

    def _sweep(self) -> None:
        """Start the watchers of the steps now due; the timer follows the oldest left."""
        self._sweep_timer = None
        loop, every = asyncio.get_running_loop(), self._settings.progress_every_s
        due = loop.time() - every
        unwatched = self._unwatched
        while unwatched:
            watch, started = next(iter(unwatched.items()))
            if started > due:
                self._sweep_timer = loop.call_at(started + every, self._sweep)
                return
            del unwatched[watch]
            watch.start(waited=True)

    async def _watch(
        self, engine: Engine, done: asyncio.Future[None], *, waited: bool, stall_s: float
    ) -> None:
        """Probe ``engine`` until ``done``; EngineFailure when it hangs or stalls. ``waited``:
        the step has run ``progress_every_s`` already, and the engine answered lately."""
        if not waited:
            await self._answers_at_start(engine, done)
        unanswered = 0
        reading: Progress | None = None
        changed = time.monotonic()
        while not done.done():
            if not waited:
                await asyncio.wait({done}, timeout=self._settings.progress_every_s)
                if done.done():
                    return
            waited = False
            now_reading = await self._progress(engine)
            if done.done():
                return
            if isinstance(now_reading, _NotAsked):  # the router could not ask: nothing learnt
                continue
            if now_reading is None:
                unanswered += 1
                if unanswered >= self._settings.unanswered_probes:
                    raise EngineFailure(
                        engine, "hang", f"no answer to {unanswered} progress probes in a row"
                    )
                continue
            unanswered = 0
            if now_reading != reading:
                reading, changed = now_reading, time.monotonic()
            elif time.monotonic() - changed >= stall_s:
                raise EngineFailure(engine, "stall", f"no progress in {stall_s:g} s")

    async def _answers_at_start(self, engine: Engine, done: asyncio.Future[None]) -> None:
        """Raise ``hang`` when an engine not heard from lately leaves its health probes
        unanswered while the step waits: a frozen engine accepts the step's connection and
        says nothing, and the progress reads would take seconds to tell."""
        for _ in range(self._settings.unanswered_probes):
            probe = asyncio.ensure_future(probe_health(self._http, engine, self._liveness_timeout))
            await asyncio.wait({done, probe}, return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                probe.cancel()
                return
            if probe.result() != "timeout":  # it answers, or the step's own failure will tell
                return
        raise EngineFailure(
            engine,
            "hang",
            f"no answer to {self._settings.unanswered_probes} health probes in a row "
            f"({self._settings.liveness_timeout_s:g} s each)",
        )

    async def _progress(self, engine: Engine) -> Reading:
        now = time.monotonic()
        started, read = self._reads.get(engine, (-math.inf, None))
        if read is None or now - started >= self._settings.progress_every_s / 2:
            read = asyncio.ensure_future(self._read_progress(engine))
            self._reads[engine] = (now, read)
        return await asyncio.shield(read)  # a step that ends must not cancel the others' read

    async def _read_progress(self, engine: Engine) -> Reading:
        """The engine's progress series; None when it does not answer, NOT_ASKED when the
        router could not ask it.

        An engine without those series answers a fresh reading each time: answering is all
        the progress it can show.
        """
        try:
            answer = await self._http.fetch(f"{engine.url}/metrics", self._probe_timeout)
        except HTTPLocalError:
            return NOT_ASKED
        except (HTTPError, asyncio.TimeoutError):
            return None
        text = answer.body.decode("utf-8", "replace") if answer.status == 200 else ""
        progress = progress_of(text)
        return (time.monotonic(),) if progress is None else progress


_WATCHERS: set[asyncio.Task[None]] = set()
"""Watcher tasks running (the loop keeps only weak references to tasks)."""


class _StepWatch:
    """The watchdog over one step that runs in the caller's task.

    Most steps end long before ``progress_every_s`` and their engine answered lately: they get
    no watcher, only an entry in the watchdog's list of unwatched steps (a task and an
    ``asyncio.wait`` per step were ~10% of the router's CPU). A watcher that finds a hang or
    stall keeps it in :attr:`failure` and cancels the caller, which closes the step's
    connection (vLLM aborts the request).
    """

    __slots__ = ("_done", "_engine", "_owner", "_stall_s", "_watchdog", "failure")

    def __init__(self, watchdog: Watchdog, engine: Engine, stall_s: float) -> None:
        self._watchdog = watchdog
        self._engine = engine
        self._stall_s = stall_s
        self._owner = asyncio.current_task()
        self._done: asyncio.Future[None] | None = None
        self.failure: EngineFailure | None = None

    def start(self, *, waited: bool) -> None:
        """Start the watcher; ``waited``: the step has run ``progress_every_s`` already."""
        self._done = asyncio.get_running_loop().create_future()
        watcher = asyncio.ensure_future(self._watch(self._done, waited))
        _WATCHERS.add(watcher)
        watcher.add_done_callback(_WATCHERS.discard)

    async def _watch(self, done: asyncio.Future[None], waited: bool) -> None:
        try:
            await self._watchdog._watch(self._engine, done, waited=waited, stall_s=self._stall_s)
        except EngineFailure as failure:
            if not done.done() and self._owner is not None:
                # Should the step's answer arrive in this very loop iteration, it is lost to
                # the cancel: the step counts as hung, as it would one iteration later.
                self.failure = failure
                self._owner.cancel()

    def end(self) -> None:
        """The step is over: its watcher ends (and its health probe with it)."""
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def cancelled_from_outside(self) -> bool:
        """Whether the caller was also cancelled by someone else (that cancel goes on)."""
        uncancel = getattr(self._owner, "uncancel", None)  # Python 3.11+
        return uncancel is not None and uncancel() > 0


def progress_of(text: str) -> Progress | None:
    """Each of :data:`PROGRESS_SERIES` summed over its label sets (an engine with several
    cores reports one per core); None when the text has none of them."""
    totals = dict.fromkeys(PROGRESS_SERIES, 0.0)
    found = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            with contextlib.suppress(ValueError, IndexError):
                totals[name] += float(line.rsplit(" ", 1)[1])
                found = True
    return tuple(totals.values()) if found else None
