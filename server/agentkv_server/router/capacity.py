"""Retained KV within each decode engine's capacity: the budget, what each holding is worth, and
which holdings go first when KV runs short (docs/router.md, "Capacity").

An engine's capacity comes from its connector's holding params (``agentkv_kv_cache_tokens``,
``agentkv_kv_bytes_per_token``: the connector reads vLLM's KV cache config), or from the settings
for engines that do not report it. What it holds is the sum of the holdings this router recorded
there (their ``remote_num_tokens``): exact and free, where the engines' own usage metrics mix
retained blocks with running requests and the prefix cache.

A holding's value is the prefill time it saves at its session's next turn, per byte-second it
occupies until then::

    value = s_per_token * tokens * chance / (tokens * bytes_per_token * wait_s)

``s_per_token`` is the policy's fitted prefill rate; ``wait_s`` the predicted time left until
the next turn (at least ``_MIN_WAIT_S``; once overdue, growing with the silence); ``chance``
that the turn comes: the confidence of the prediction (a client hint, else this session's
measured gap, else every session's), decaying once the predicted moment has passed. A holding
silent for ``abandon_factor`` times its hinted gap is abandoned: worth nothing, the first to go
when room is needed, but not released before (with memory to spare, releasing it can only cost
a recompute: tool gaps are heavy-tailed). Expired ones are gone. The ledger only decides; the
keeper (holdings.py) takes what it names out of the store and releases it.

On an engine with a host tier below its KV cache (``agentkv_host_tier_tokens``: connector/
hosttier.py) a holding released to make room leaves its KV there, until newer blocks push it
out. The ledger remembers such holdings, newest first, as far as the tier's size goes, so that
the session's next turn continues on that engine and loads its history back instead of
recomputing it; the tier also stores what other requests compute, so this is an estimate, and a
turn that finds less there computes the rest on the engine.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from agentkv_server import wire
from agentkv_server.router.metrics import EngineKVFigures, RouterMetrics
from agentkv_server.router.sessions import Holding
from agentkv_server.settings import CapacitySettings

__all__ = ["CapacityLedger", "EngineKV", "Held", "ReleaseReason", "Released", "holding_value"]

ReleaseReason = Literal["pressure", "live_turn", "session_end", "abandoned", "expired"]
"""``pressure``: a new holding did not fit the budget; ``live_turn``: a decode step needed the
room; ``session_end``: the session ended; ``abandoned``: room was needed (either way) and the
holding had had no turn for far longer than predicted; ``expired``: its retention ran out (the
engine freed it itself)."""

# Chance that the next turn comes, by what predicted it: the client said when (the SDK sends a
# prediction only when it expects another call), the session's own past gaps, or nothing.
_HINTED, _MEASURED, _UNKNOWN = 1.0, 0.75, 0.5
# Where an abandoned holding ranks: below every value (which is never negative).
_ABANDONED = -1.0
# A turn predicted any moment now still occupies its KV for about a step's time.
_MIN_WAIT_S = 1.0
# A decode step's room is reserved from make_room until its KV is recorded as a holding (or its
# ticket is voided); a reservation whose end this router never saw (the step failed, or its
# report reached another replica) is forgotten after this long.
_STEP_TTL_S = 120.0
# Weight of each new sample in the running means (all sessions' gap, a decode step's tokens), and
# how many sessions' gaps (and pressure releases) are remembered.
_EWMA_ALPHA = 0.2
_MAX_REMEMBERED = 65_536


class Released(NamedTuple):
    """A session's holding that went to make room, until the session's next turn."""

    tokens: int
    reason: ReleaseReason
    in_host_tier: Holding | None = None
    """The holding, while its KV is likely still in its engine's host tier; else None."""


@dataclass(frozen=True)
class Held:
    """A holding as the ledger weighs it: when its next turn is expected, and how surely."""

    holding: Holding
    recorded_at: float
    gap_s: float
    """Predicted seconds from ``recorded_at`` to the session's next turn."""
    confidence: float

    @property
    def tokens(self) -> int:
        return self.holding.num_tokens

    def chance(self, now: float) -> float:
        """The chance that the next turn still comes: full until its predicted moment, then
        decaying with one gap as the time constant."""
        late = now - self.recorded_at - self.gap_s
        if late <= 0:
            return self.confidence
        return self.confidence * math.exp(-late / max(self.gap_s, _MIN_WAIT_S))

    def wait_s(self, now: float) -> float:
        """Seconds the KV is expected to stay held for its turn: until the predicted moment,
        or, once overdue by x, about x more (the longer a silence, the longer it lasts)."""
        return max(abs(self.recorded_at + self.gap_s - now), _MIN_WAIT_S)

    def abandoned(self, now: float, settings: CapacitySettings) -> bool:
        """Silent far longer than the client said. Only a client's hint can say so: tool gaps
        are heavy-tailed, so a gap measured or guessed from other sessions (0.5 s last time)
        says little about the next one (a minute-long tool call), and releasing such a
        holding with memory to spare costs a recompute for nothing. Its value still decays
        with the silence, so under pressure it goes early anyway."""
        if self.confidence < _HINTED:
            return False
        limit = self.gap_s * settings.abandon_factor + settings.abandon_slack_s
        return now - self.recorded_at > limit


def holding_value(held: Held, now: float, s_per_token: float, bytes_per_token: float) -> float:
    """Expected prefill seconds saved at the next turn, per byte-second held until it."""
    saved_s = s_per_token * held.tokens * held.chance(now)
    return saved_s / (held.tokens * bytes_per_token * held.wait_s(now))


@dataclass
class EngineKV:
    """One decode engine's KV as the router accounts for it."""

    capacity_tokens: int | None = None
    bytes_per_token: float | None = None
    block_size: int = 1
    """Tokens per KV block: a holding occupies whole blocks."""
    held: dict[str, Held] = field(default_factory=dict)
    """By session key; change it through :meth:`put` and :meth:`pop`, which keep the total."""
    held_tokens: int = 0
    """What the holdings occupy, in whole blocks' tokens."""
    steps: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Decode steps sent with a ticket whose KV is not recorded yet, by ticket: the tokens
    (whole blocks) their prompts occupy, and when the reservation is forgotten."""
    reads: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Holdings taken for a pull, by session key, in the same form: their blocks stay on the
    engine until the prefill engine has read them, which can wait behind its queue."""
    host_tokens: int | None = None
    """The host tier's size in tokens; None: the engine has none."""
    spilled: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Sessions whose released holding's KV is taken to be in the host tier, oldest first,
    with its tokens (whole blocks); change it through :meth:`spill`."""
    spilled_tokens: int = 0

    def spill(self, session_key: str, tokens: int) -> list[str]:
        """Count a released holding's KV as in the host tier; the sessions (oldest first)
        whose KV it is taken to push out, the tier's least recently stored blocks."""
        self.unspill(session_key)
        self.spilled[session_key] = tokens
        self.spilled_tokens += tokens
        pushed_out = []
        while self.spilled_tokens > (self.host_tokens or 0):
            key, oldest = self.spilled.popitem(last=False)
            self.spilled_tokens -= oldest
            pushed_out.append(key)
        return pushed_out

    def unspill(self, session_key: str) -> None:
        self.spilled_tokens -= self.spilled.pop(session_key, 0)

    def put(self, session_key: str, entry: Held) -> None:
        self.pop(session_key)
        self.held[session_key] = entry
        self.held_tokens += self.in_blocks(entry.tokens)

    def pop(self, session_key: str) -> Held | None:
        entry = self.held.pop(session_key, None)
        if entry is not None:
            self.held_tokens -= self.in_blocks(entry.tokens)
        return entry

    def in_blocks(self, tokens: int) -> int:
        """``tokens`` rounded up to whole blocks."""
        return -(-tokens // self.block_size) * self.block_size

    def budget_tokens(self, fraction: float) -> int | None:
        if self.capacity_tokens is None:
            return None
        return int(self.capacity_tokens * fraction)


class CapacityLedger:
    """Which holdings each decode engine keeps, within its budget, ranked by value."""

    def __init__(
        self,
        settings: CapacitySettings,
        metrics: RouterMetrics,
        *,
        default_gap_s: float,
        prefill_s_per_token: Callable[[], float],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._default_gap_s = default_gap_s
        self._s_per_token = prefill_s_per_token
        self._clock = clock
        self._engines: dict[str, EngineKV] = {}
        self._where: dict[str, str] = {}  # session key -> decode URL of its holding
        self._gaps: OrderedDict[str, float] = OrderedDict()  # measured, per session
        self._mean_gap_s: float | None = None
        # Sessions whose holding went to make room, until their next turn.
        self._released: OrderedDict[str, Released] = OrderedDict()
        self._mean_step_tokens: float | None = None
        self._mean_output_tokens: float | None = None  # what recorded answers added, + 1
        # ticket -> decode URL of its reserved step, and the step's prompt tokens
        self._step_where: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def engine(self, url: str) -> EngineKV:
        engine = self._engines.get(url)
        if engine is None:
            engine = self._engines[url] = EngineKV(capacity_tokens=self._settings.engine_tokens)
        return engine

    def figures(self) -> list[EngineKVFigures]:
        """Each decode engine's retained KV, for the metrics."""
        figures = []
        for url, engine in self._engines.items():
            held = engine.held_tokens
            per_token = engine.bytes_per_token
            figures.append(
                EngineKVFigures(
                    url=url,
                    held_tokens=held,
                    held_bytes=None if per_token is None else held * per_token,
                    capacity_tokens=engine.capacity_tokens,
                    budget_tokens=self.budget_tokens(url),
                )
            )
        return figures

    def budget_tokens(self, url: str) -> int | None:
        return self.engine(url).budget_tokens(self._settings.retained_fraction)

    def add(self, holding: Holding, next_turn_s: float | None) -> list[Holding]:
        """Account for a recorded holding; the holdings (perhaps this one) to release so
        that its engine stays within budget."""
        self.discard(holding.session_key)
        engine = self.engine(holding.decode_url)
        _learn(engine, holding.params)
        engine.put(holding.session_key, self._weigh(holding, next_turn_s))
        self._where[holding.session_key] = holding.decode_url
        budget, capacity = self.budget_tokens(holding.decode_url), engine.capacity_tokens
        if not self._settings.enabled or budget is None or capacity is None:
            return []
        victims = self._shed(engine, lambda: engine.held_tokens > budget, "pressure")
        # The steps reserved there since their make_room must still fit beside the holdings:
        # a holding recorded meanwhile would take the room of a step whose sliced prefill is
        # still claiming blocks, which then waits for them (docs/router.md, "Capacity").
        room = capacity - self._reserved_tokens(engine)
        return victims + self._shed(engine, lambda: engine.held_tokens > room, "live_turn")

    def make_room(
        self,
        url: str,
        tokens: int,
        running: int,
        step: str | None = None,
        output_limit: int | None = None,
    ) -> list[Holding]:
        """Holdings to release before a decode step of ``tokens`` on ``url``, beside
        ``running`` other steps, so that it never waits for blocks the holdings occupy.

        A step occupies its prompt and the answer it grows as it decodes: ``output_limit``
        tokens at most (None: unbounded), as the answers recorded so far suggest when fewer.
        The steps sent with a ticket (``step``) count at their own size until their KV is
        recorded (:meth:`step_ended`), the others at the mean step size: a mean alone missed
        several large steps arriving together, and a step between this call and its sending,
        which is not yet in ``running`` (the connector's waits for blocks showed both)."""
        size = tokens + self._expected_output(output_limit)
        mean = self._mean_step_tokens
        if tokens > 0:
            mean = self._mean_step_tokens = (
                size if mean is None else mean + _EWMA_ALPHA * (size - mean)
            )
        if step is not None:
            _bounded_put(self._step_where, step, (url, tokens))
        engine = self.engine(url)
        if not self._settings.enabled or engine.capacity_tokens is None:
            return []
        need = engine.in_blocks(size)  # whole blocks, as vLLM allocates them
        reserved = self._reserved_tokens(engine)
        unreserved = max(running - len(engine.steps), 0)
        room = engine.capacity_tokens - need - reserved - unreserved * (mean or 0.0)
        victims = self._shed(engine, lambda: engine.held_tokens > room, "live_turn")
        if step is not None:
            engine.steps[step] = (need, self._clock() + _STEP_TTL_S)
        return victims

    def step_ended(self, step: str, recorded_tokens: int | None = None) -> None:
        """The ticketed step's KV is recorded as a holding of ``recorded_tokens`` (or it
        broke: None): its room is the holding's now, and the answer's length is learned."""
        where = self._step_where.pop(step, None)
        if where is None:
            return
        url, prompt_tokens = where
        self.engine(url).steps.pop(step, None)
        if recorded_tokens is not None and prompt_tokens > 0:
            grown = max(recorded_tokens - prompt_tokens, 0) + 1
            mean = self._mean_output_tokens
            self._mean_output_tokens = (
                grown if mean is None else mean + _EWMA_ALPHA * (grown - mean)
            )

    def _expected_output(self, output_limit: int | None) -> int:
        """The tokens a step's answer is expected to add to its KV: its limit, or twice the
        mean recorded answer when that is less (answers vary; a limit is often set far above
        any answer); one (the first token, which vLLM allocates with the prompt) while
        neither is known. A running step that grew past its prompt's last block took one
        beside the holdings: with 128-token blocks and 32-token answers a quarter of the steps
        do (docs/router.md, "Capacity")."""
        mean = self._mean_output_tokens
        bounds = (output_limit, None if mean is None else math.ceil(2 * mean))
        return min((bound for bound in bounds if bound), default=1)

    def pull_started(self, holding: Holding) -> None:
        """A turn took ``holding`` to pull it: its blocks count against the engine's room
        until :meth:`pull_ended`. A pull queued behind cold prompts on a busy prefill engine
        kept them there for seconds while decode steps waited for blocks
        (docs/benchmarks.md, "A tier below decode memory")."""
        engine = self.engine(holding.decode_url)
        tokens = engine.in_blocks(holding.num_tokens)
        engine.reads[holding.session_key] = (tokens, self._clock() + _STEP_TTL_S)

    def pull_ended(self, holding: Holding) -> None:
        """The prefill engine read the holding, or gave up and it was released."""
        self.engine(holding.decode_url).reads.pop(holding.session_key, None)

    def _reserved_tokens(self, engine: EngineKV) -> int:
        """The tokens of the engine's reserved steps and reads, forgetting those past their
        time."""
        now = self._clock()
        for step in [step for step, (_, until) in engine.steps.items() if until <= now]:
            del engine.steps[step]
            self._step_where.pop(step, None)
        for key in [key for key, (_, until) in engine.reads.items() if until <= now]:
            del engine.reads[key]
        reserved = (*engine.steps.values(), *engine.reads.values())
        return sum(tokens for tokens, _ in reserved)

    def taken(self, session_key: str, holding: Holding | None) -> Released | None:
        """A turn of the session took its holding (None: it found none); when it found none
        because the holding went to make room, why it went, and whether its KV is in a host
        tier (else the turn lost that reuse to pressure)."""
        if holding is not None:
            entry = self._pop(session_key)
            if entry is not None:
                self._learn_gap(session_key, self._clock() - entry.recorded_at)
        released = self._pop_released(session_key)
        if holding is not None or released is None:
            return None
        if released.in_host_tier is None:
            self._metrics.record_reuse_lost_to_pressure(released.tokens)
        return released

    def ended(self, session_key: str) -> None:
        """The session ended: its holding is released (by the keeper) for that reason."""
        if self._pop(session_key) is not None:
            self._metrics.record_kv_release("session_end")
        self._pop_released(session_key)

    def discard(self, session_key: str, holding: Holding | None = None) -> None:
        """Stop accounting for the session's holding (``holding`` given: only if it is that
        one), released for a reason counted elsewhere (replaced, refused, evicted)."""
        url = self._where.get(session_key)
        entry = self._engines[url].held.get(session_key) if url is not None else None
        if entry is not None and (holding is None or entry.holding == holding):
            self._pop(session_key)

    def sweep(self) -> None:
        """Forget the holdings whose retention ran out (the engines freed them)."""
        now = self._clock()
        for engine in self._engines.values():
            for key, entry in list(engine.held.items()):
                if entry.holding.expires_at <= now:
                    self._pop(key)
                    self._metrics.record_kv_release("expired")

    def _shed(
        self, engine: EngineKV, over: Callable[[], bool], reason: ReleaseReason
    ) -> list[Holding]:
        """The least valuable holdings of ``engine``, abandoned ones first, in order, while
        ``over()``."""
        if not over():  # the common case: no ranking on a turn's path
            return []
        now = self._clock()
        s_per_token = self._s_per_token()
        per_token = engine.bytes_per_token or 1.0
        ranked = [
            (self._worth(entry, now, s_per_token, per_token), -entry.tokens, key)
            for key, entry in engine.held.items()
        ]
        heapq.heapify(ranked)  # most often one or two go: no full sort
        victims = []
        while ranked and over():
            worth, _, key = heapq.heappop(ranked)
            entry = engine.held[key]
            self._pop(key)
            why: ReleaseReason = "abandoned" if worth == _ABANDONED else reason
            self._remember_released(engine, entry, why)
            self._metrics.record_kv_release(why)
            victims.append(entry.holding)
        return victims

    def _remember_released(self, engine: EngineKV, entry: Held, why: ReleaseReason) -> None:
        """Remember why the session's holding went, and, on an engine with a host tier, that
        its KV is there now (pushing older spilled KV out of the ledger's account)."""
        key = entry.holding.session_key
        if engine.host_tokens is None:
            _bounded_put(self._released, key, Released(entry.tokens, why))
            return
        _bounded_put(self._released, key, Released(entry.tokens, why, entry.holding))
        for pushed_out in engine.spill(key, engine.in_blocks(entry.tokens)):
            released = self._released.get(pushed_out)
            if released is not None:
                self._released[pushed_out] = released._replace(in_host_tier=None)

    def _pop_released(self, session_key: str) -> Released | None:
        released = self._released.pop(session_key, None)
        if released is not None and released.in_host_tier is not None:
            self.engine(released.in_host_tier.decode_url).unspill(session_key)
        return released

    def _worth(self, entry: Held, now: float, s_per_token: float, per_token: float) -> float:
        """A holding's value, or below any value for an abandoned one."""
        if entry.abandoned(now, self._settings):
            return _ABANDONED
        return holding_value(entry, now, s_per_token, per_token)

    def _weigh(self, holding: Holding, next_turn_s: float | None) -> Held:
        if next_turn_s is not None:
            gap_s, confidence = next_turn_s, _HINTED
        elif (measured := self._gaps.get(holding.session_key)) is not None:
            gap_s, confidence = measured, _MEASURED
        else:
            gap_s, confidence = self._mean_gap_s or self._default_gap_s, _UNKNOWN
        return Held(holding, self._clock(), gap_s, confidence)

    def _learn_gap(self, session_key: str, gap_s: float) -> None:
        _bounded_put(self._gaps, session_key, gap_s)
        mean = self._mean_gap_s
        self._mean_gap_s = gap_s if mean is None else mean + _EWMA_ALPHA * (gap_s - mean)

    def _pop(self, session_key: str) -> Held | None:
        url = self._where.pop(session_key, None)
        return None if url is None else self._engines[url].pop(session_key)


def _learn(engine: EngineKV, params: Mapping[str, Any]) -> None:
    """Capacity, bytes per token and block size from the connector's params, when it sent
    them (the block size is the prefix fingerprint's, the engine's own); only while the engine
    holds nothing, so that the block-rounded total stays consistent."""
    capacity = params.get(wire.KV_CACHE_TOKENS)
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
        engine.capacity_tokens = capacity
    per_token = params.get(wire.KV_BYTES_PER_TOKEN)
    if isinstance(per_token, (int, float)) and not isinstance(per_token, bool) and per_token > 0:
        engine.bytes_per_token = float(per_token)
    block_size = params.get(wire.HASH_BLOCK_SIZE)
    if isinstance(block_size, int) and block_size > 0 and not engine.held:
        engine.block_size = block_size
    host = params.get(wire.HOST_TIER_TOKENS)
    if isinstance(host, int) and not isinstance(host, bool) and host > 0:
        engine.host_tokens = host


def _bounded_put(items: OrderedDict[str, Any], key: str, value: Any) -> None:
    items[key] = value
    items.move_to_end(key)
    while len(items) > _MAX_REMEMBERED:
        items.popitem(last=False)
