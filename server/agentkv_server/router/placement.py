"""Engines, their load and health, and the choice of engine for each step.

Load is the number of requests this router has in flight on an engine (a replica sees only its
own share, which is enough to spread work). Health is passive (a step's failure marks its engine
down at once when it blames the engine: failures.py) and active (``HealthMonitor`` probes
``GET /health`` periodically and brings engines back). An engine that refused a new connection
is *lost*: its process is gone or restarted, so every holding issued before that moment is void
(checked lazily against ``lost_at``: no store scan, and right for every store).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from agentkv_server.router.failures import LOST, SUSPECT, ErrorKind, wire_kind
from agentkv_server.router.fit import LinearFit
from agentkv_server.router.http_client import HTTPClient, HTTPError, Timeout
from agentkv_server.router.queue import StepQueue

__all__ = [
    "TAIL_WINDOW_GAPS",
    "Engine",
    "EnginePool",
    "HealthMonitor",
    "Role",
    "StepTimes",
    "probe_health",
]

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]

# Weight of each new gap in StepTimes' running mean of plain steps: a few dozen steps of memory.
_STEP_ALPHA = 0.05
# Weight of each local prefill's measurement in the fit of what slices add (the cost model's
# default weight: a measurement is a whole turn's worth of steps, not one gap).
_ADDED_ALPHA = 0.2
# The recent gaps over which an engine counts those its local prefills slowed: a p99 over
# 2000 gaps is their 20 slowest, so the share is read on the scale the tail is.
TAIL_WINDOW_GAPS = 2000


class StepTimes:
    """The gaps between chunks of the streams an engine sends through this router, apart while a
    local prefill runs on it or a prefill engine pulls from it: the difference is what those add
    to its decode steps, measured where the holder's other sessions feel it.

    Each local prefill is one measurement: the mean gap while it ran, less the plain steps'
    running mean, against the tokens its slices attend to (its prompt). A slice's attention
    grows with that context: on the CPU stack a step carrying 64 new tokens over a 4k-token
    history took ~0.4 s, over 1k ~0.17 s, a plain one ~0.08 s (docs/router.md), so a cost
    learned at one history length is scaled, not reused, at another.

    Each pull's P step is one measurement too, of the delay each running sequence took over
    the whole step (its fewer, slower steps: seconds x (1 - plain gap / mean gap)), against the
    tokens read: the holder serves the read between its decode steps, and P's compute of the
    new part after it costs the holder nothing.

    Of its last gaps (up to ``TAIL_WINDOW_GAPS``) it counts those that ran beside a local prefill
    (``slowed_gaps``): what slices add bounds how slow such a gap is, this share how many
    there are, and a TPOT p99 moves only once they are more than 1 % of the gaps.
    """

    __slots__ = (
        "_added",
        "_prefills",
        "_read_delay",
        "_reads",
        "_recent",
        "plain_s",
        "slowed_gaps",
    )

    def __init__(self) -> None:
        self.plain_s: float | None = None
        self._added: LinearFit | None = None
        self._read_delay: LinearFit | None = None
        self._prefills = _Window()  # local prefills: tokens their slices attend to
        self._reads = _Window()  # pulls' P steps: tokens read from this engine
        self._recent: deque[bool] = deque(maxlen=TAIL_WINDOW_GAPS)  # beside a local prefill?
        self.slowed_gaps = 0

    @property
    def local_prefills(self) -> int:
        """Local turns sent to the engine whose first byte has not come back yet."""
        return self._prefills.open

    def observe(self, gap_s: float) -> None:
        windows = [window for window in (self._prefills, self._reads) if window.open]
        for window in windows:
            window.gaps.append(gap_s)
        if not windows:
            self.plain_s = _running_mean(self.plain_s, gap_s)
        self._count(slowed=bool(self._prefills.open))

    @property
    def window_gaps(self) -> int | None:
        """The recent gaps ``slowed_gaps`` is counted over: all seen, up to the last
        ``TAIL_WINDOW_GAPS``. Not the window's full length from the first gap on: each bench
        repeat starts a router, and priced against 2000 gaps not yet seen, its first 1k-token
        phase let local prefills slow 40 of the decoders' 2765 gaps (1.4 %; their p99 176 ms,
        89 ms without them). None before the first gap: a router that relays none of the
        engine's streams (another replica's sessions) has no tail of it to count."""
        return len(self._recent) or None

    @property
    def slowed_share(self) -> float | None:
        """``slowed_gaps`` as a share of ``window_gaps`` (None before the first gap)."""
        window = self.window_gaps
        return None if window is None else self.slowed_gaps / window

    def _count(self, *, slowed: bool) -> None:
        recent = self._recent
        if len(recent) == recent.maxlen and recent[0]:
            self.slowed_gaps -= 1
        recent.append(slowed)
        self.slowed_gaps += slowed

    @property
    def prefilling_tokens(self) -> int:
        """The tokens the local prefills running now attend to: a new one's slices ride on the
        same steps as theirs, so what it adds is priced at its prompt plus these."""
        return self._prefills.tokens

    def added_s(self, context_tokens: int) -> float | None:
        """Seconds local prefills attending to ``context_tokens`` in all add to each decode step,
        once a local prefill was seen beside plain steps."""
        return _at(self._added, context_tokens)

    def read_delay_s(self, tokens: int) -> float | None:
        """Seconds a pull of ``tokens`` adds to each running sequence over its P step in all,
        once a pull was seen beside plain steps."""
        return _at(self._read_delay, tokens)

    def local_prefill(self, context_tokens: int) -> contextlib.AbstractContextManager[None]:
        """Count a local turn's prefill for the duration of the block (until its first byte):
        the gaps meanwhile are measured against its prompt's ``context_tokens``."""
        return self._prefills.during(context_tokens, self._learn_added)

    def pull_read(self, tokens: int) -> contextlib.AbstractContextManager[None]:
        """Count a P step that pulls ``tokens`` from this engine for the duration of the block:
        the gaps meanwhile are measured against them."""
        return self._reads.during(tokens, self._learn_read_delay)

    def _learn_added(self, gaps: list[float], tokens: int, _seconds: float) -> None:
        if gaps and self.plain_s is not None:
            added = max(sum(gaps) / len(gaps) - self.plain_s, 0.0)
            self._added = _fitted(self._added, tokens, added)

    def _learn_read_delay(self, gaps: list[float], tokens: int, seconds: float) -> None:
        if gaps and self.plain_s is not None:
            delay = seconds * max(1.0 - self.plain_s * len(gaps) / sum(gaps), 0.0)
            self._read_delay = _fitted(self._read_delay, tokens, delay)


class _Window:
    """The gaps seen while steps of one kind run on an engine, and the tokens they concern;
    overlapping steps are one measurement, closed when the last of them ends."""

    __slots__ = ("gaps", "open", "opened_at", "tokens")

    def __init__(self) -> None:
        self.open = 0
        self.gaps: list[float] = []
        self.tokens = 0
        self.opened_at = 0.0

    @contextlib.contextmanager
    def during(
        self, tokens: int, learn: Callable[[list[float], int, float], None]
    ) -> Iterator[None]:
        if not self.open:
            self.opened_at = time.monotonic()
        self.open += 1
        self.tokens += tokens
        try:
            yield
        finally:
            self.open -= 1
            if not self.open:
                gaps, tokens = self.gaps, self.tokens
                self.gaps, self.tokens = [], 0
                learn(gaps, tokens, time.monotonic() - self.opened_at)


def _fitted(fit: LinearFit | None, tokens: int, seconds: float) -> LinearFit:
    if fit is None:  # anchored at nothing added for no tokens
        fit = LinearFit(0.0, 0.0, _ADDED_ALPHA)
    fit.add(tokens, seconds)
    return fit


def _at(fit: LinearFit | None, tokens: int) -> float | None:
    if fit is None:
        return None
    intercept, slope = fit.line()
    return max(intercept + slope * tokens, 0.0)


def _running_mean(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + _STEP_ALPHA * (sample - mean)


@dataclass(eq=False)
class Engine:
    """One vLLM engine as the router sees it."""

    url: str
    role: Role
    healthy: bool = True
    inflight: int = 0
    failed_probes: int = 0
    lost_at: float = 0.0  # wall clock (holdings' clock) of the last refused connection
    answered_at: float = -math.inf  # monotonic time of the last answer seen from it
    steps: StepTimes = field(default_factory=StepTimes)
    queue: StepQueue = field(default_factory=StepQueue)
    on_down: Callable[[Engine, str], None] | None = field(default=None, repr=False)
    """Told each time the engine goes from healthy to down, and why (a failure's kind, or
    ``health``: its periodic probes failed)."""

    @property
    def backlog_s(self) -> float:
        """About how long a new step waits for this engine: behind the steps in flight here
        and those the router holds back for it (queue.StepQueue)."""
        return self.queue.backlog_s() + self.queue.held_s()

    def mark_answered(self) -> None:
        self.answered_at = time.monotonic()

    def answered_within(self, seconds: float) -> bool:
        return time.monotonic() - self.answered_at <= seconds

    def mark_suspect(self, why: str) -> None:
        """No new work until a health probe passes (a step hung, timed out or was dropped:
        ``why``)."""
        self._mark_down(why)

    def mark_lost(self) -> None:
        """The engine refused a new connection: down, and the KV it held is gone with it."""
        self.lost_at = time.time()
        self._mark_down("connect")

    def mark_up(self) -> None:
        self.healthy = True

    def _mark_down(self, why: str) -> None:
        if self.healthy:
            self.healthy = False
            if self.on_down is not None:
                self.on_down(self, why)

    def record_failure(self, kind: ErrorKind) -> None:
        """A step on this engine failed: lost on a refused new connection, suspect when it
        dropped the connection, answered nothing in time or made no progress; unchanged when
        the answer itself was bad or the router failed."""
        if kind in LOST:
            self.mark_lost()
        elif kind in SUSPECT:
            self.mark_suspect(kind)

    def may_hold(self, issued_at: float) -> bool:
        """Whether KV recorded for a turn issued at ``issued_at`` can still be on the engine."""
        return issued_at > self.lost_at

    def may_serve_holding(self, issued_at: float) -> bool:
        """Healthy, and not lost since the holding was recorded: a turn may use its KV here."""
        return self.healthy and self.may_hold(issued_at)

    def request_started(self) -> None:
        """Count a request in flight until :meth:`request_finished` (a stream outlives a block)."""
        self.inflight += 1

    def request_finished(self) -> None:
        self.inflight -= 1

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Count a request in flight for the duration of the block."""
        self.request_started()
        try:
            yield
        finally:
            self.request_finished()

    def snapshot(self) -> dict[str, object]:
        return {"url": self.url, "healthy": self.healthy, "inflight": self.inflight}


class EnginePool:
    """The engines of one role.

    With ``last_resort``, a pool whose engines all look down still offers them (least loaded
    first) rather than nothing: health can be wrong (a probe timing out under load), and for
    decode there is no other way to serve. Prefill has one (decode-only serving), so its pool
    offers only healthy engines.
    """

    def __init__(
        self,
        role: Role,
        urls: Iterable[str],
        *,
        last_resort: bool = False,
        queue: Callable[[], StepQueue] = StepQueue,
        on_down: Callable[[Engine, str], None] | None = None,
    ) -> None:
        self.role = role
        self.last_resort = last_resort
        self.engines = [Engine(url, role, queue=queue(), on_down=on_down) for url in urls]
        self._by_url = {engine.url: engine for engine in self.engines}
        self._turn = itertools.count()

    def get(self, url: str) -> Engine | None:
        return self._by_url.get(url)

    def pick(self, *, prefer: str | None = None, exclude: Iterable[Engine] = ()) -> Engine | None:
        """The preferred engine if it is usable, else the least loaded healthy one: the
        shortest queue (StepQueue: prefill engines), then the fewest requests in flight.

        Ties rotate, so an idle pool still spreads requests.
        """
        excluded = set(exclude)
        preferred = self._by_url.get(prefer) if prefer else None
        if preferred is not None and preferred.healthy and preferred not in excluded:
            return preferred
        usable = [e for e in self.engines if e not in excluded]
        candidates = [e for e in usable if e.healthy] or (usable if self.last_resort else [])
        if not candidates:
            return None
        offset = next(self._turn) % len(candidates)
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda engine: (engine.backlog_s, engine.inflight))

    def any_healthy(self) -> bool:
        return any(engine.healthy for engine in self.engines)

    def measured(self, engine: Engine, cost: Callable[[StepTimes], float | None]) -> float | None:
        """``cost`` as ``engine``'s own streams showed it, else, until they have, the mean of
        what the pool's other engines' showed: they serve one model on like hardware, so what
        one decoder measured prices the others' first local turns beside running sequences,
        which at the bound would each be a try of their own (docs/router.md, "Three paths")."""
        own = cost(engine.steps)
        if own is not None:
            return own
        peers = [c for e in self.engines if e is not engine and (c := cost(e.steps)) is not None]
        return sum(peers) / len(peers) if peers else None


class HealthMonitor:
    """Probes every engine's ``/health`` every ``interval_s`` seconds.

    One good probe brings an engine back; it takes ``failures_to_down`` failed probes in a row to
    mark one down, so a single slow answer under load does not take an engine out.
    """

    def __init__(
        self,
        pools: Iterable[EnginePool],
        http: HTTPClient,
        *,
        interval_s: float,
        timeout_s: float,
        failures_to_down: int = 2,
    ) -> None:
        self._engines = [engine for pool in pools for engine in pool.engines]
        self._http = http
        self._interval_s = interval_s
        self._failures_to_down = failures_to_down
        self._timeout = Timeout(total=timeout_s)
        self._task: asyncio.Task[None] | None = None

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(engine) for engine in self._engines))

    async def _check(self, engine: Engine) -> None:
        problem = await probe_health(self._http, engine, self._timeout)
        if problem == "router":  # the router could not ask: nothing learnt
            return
        healthy = problem is None
        engine.failed_probes = 0 if healthy else engine.failed_probes + 1
        if not healthy and engine.failed_probes < self._failures_to_down:
            return
        if healthy != engine.healthy:
            logger.warning(
                "%s engine %s is %s", engine.role, engine.url, "up" if healthy else "down"
            )
        if healthy:
            engine.mark_up()
        else:
            engine.mark_suspect("health")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="agentkv-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_all()


async def probe_health(http: HTTPClient, engine: Engine, timeout: Timeout) -> ErrorKind | None:
    """One ``GET /health``: None when healthy, else what went wrong.

    A refused connection (``connect``) marks the engine lost at once; ``router`` says the
    router could not ask (its own failure, nothing about the engine).
    """
    try:
        answer = await http.fetch(f"{engine.url}/health", timeout)
    except (HTTPError, asyncio.TimeoutError) as exc:
        kind = wire_kind(exc)
        if kind in LOST:
            engine.mark_lost()
        return kind
    if answer.status != 200:
        return "status"
    engine.mark_answered()
    return None
