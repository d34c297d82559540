"""The clairvoyant: the most follow-ups any retention could have reused in a decode engine's
memory, computed offline from a run's recorded trace.

Between two turns of a session its KV can be held on the decode engine, from the end of turn i
until turn i+1 starts on it (its first token); held, turn i+1 reuses it. Turns being served hold
their KV too, and they are not optional. Memory is counted in whole blocks. Knowing every next
use, the clairvoyant keeps what fits and, whenever memory runs short, drops the holding whose
next use is furthest away (Belady's rule). With holdings of one size this is the optimum: an
exchange argument shows no choice keeps more of them. With sizes that differ the exact optimum
is a knapsack problem; the rule then still drops the holding that would block memory longest,
and the figure is a strong retention's, not a proven bound (docs/benchmarks.md).

The trace is the mode's own (its turns' times depend on how it served them), so each mode is
compared with what the best retention would have reused of the same arrivals.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agentkv_server.bench.records import TurnRecord

__all__ = ["Clairvoyance", "TraceTurn", "best_reuse", "trace_of"]


@dataclass(frozen=True)
class TraceTurn:
    """One turn of a session as the engine saw it: ``start_s`` when its KV came to the decode
    engine (its first token), ``end_s`` when it finished, and the tokens it held by then."""

    session: str
    turn: int
    start_s: float
    end_s: float
    tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class Clairvoyance:
    """What the clairvoyant reused: follow-ups that found their history held, of all
    follow-ups, and the prompt tokens those reused, of all follow-up prompt tokens."""

    followups: int
    reused: int
    prompt_tokens: int
    reused_tokens: int

    @property
    def share(self) -> float | None:
        return self.reused / self.followups if self.followups else None

    @property
    def token_share(self) -> float | None:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None

    def __add__(self, other: Clairvoyance) -> Clairvoyance:
        return Clairvoyance(
            self.followups + other.followups,
            self.reused + other.reused,
            self.prompt_tokens + other.prompt_tokens,
            self.reused_tokens + other.reused_tokens,
        )


def trace_of(records: Iterable[TurnRecord]) -> list[TraceTurn]:
    """The answered turns of one run; a session stops at its first failed turn (the runner
    sends nothing after it)."""
    trace = []
    for r in records:
        if not r.ok or r.sent_s is None or r.ended_s is None or r.prompt_tokens is None:
            continue
        trace.append(
            TraceTurn(
                session=f"{r.history_tokens}:{r.session}",
                turn=r.turn,
                start_s=r.sent_s + (r.ttft_s or 0.0),
                end_s=r.ended_s,
                tokens=r.prompt_tokens + (r.output_tokens or 0),
                prompt_tokens=r.prompt_tokens,
            )
        )
    return trace


# Event kinds at one instant, in the order they apply: a finished turn frees its memory, then
# its KV becomes a holding; turns starting at that instant find their holdings before any of
# them takes memory for itself.
_END, _HOLD, _TAKE, _START = 0, 1, 2, 3


def best_reuse(
    trace: Sequence[TraceTurn], capacity_tokens: int, block_size: int = 1
) -> Clairvoyance:
    """Replay ``trace`` on a decode engine of ``capacity_tokens`` (in blocks of ``block_size``
    tokens), keeping holdings by Belady's rule; see the module's docstring."""
    capacity = capacity_tokens // block_size
    by_session: dict[str, list[TraceTurn]] = defaultdict(list)
    for turn in trace:
        by_session[turn.session].append(turn)
    events: list[tuple[float, int, int, TraceTurn, TraceTurn | None]] = []
    for turns in by_session.values():
        turns.sort(key=lambda t: t.turn)
        for index, turn in enumerate(turns):
            events.append((turn.start_s, _TAKE, len(events), turn, None))
            events.append((turn.start_s, _START, len(events), turn, None))
            events.append((turn.end_s, _END, len(events), turn, None))
            following = turns[index + 1] if index + 1 < len(turns) else None
            if following is not None and following.turn == turn.turn + 1:
                events.append((turn.end_s, _HOLD, len(events), turn, following))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    memory = _Memory(capacity)
    followups = reused = prompt = reused_tokens = 0
    for _, kind, _, turn, following in events:
        blocks = math.ceil(turn.tokens / block_size)
        if kind == _END:
            memory.active -= blocks
        elif kind == _HOLD:
            assert following is not None
            memory.hold(following, blocks, turn.tokens)
        elif kind == _TAKE:
            if turn.turn > 1:
                followups += 1
                prompt += turn.prompt_tokens
                held = memory.take(turn)
                if held is not None:
                    reused += 1
                    reused_tokens += min(held, turn.prompt_tokens)
        else:
            memory.active += blocks
            memory.fit()
    return Clairvoyance(followups, reused, prompt, reused_tokens)


class _Memory:
    """The decode engine's blocks: those of turns being served, and holdings by next use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active = 0
        # next turn -> (blocks, tokens) held for it
        self._held: dict[tuple[str, int], tuple[int, int]] = {}
        self._furthest: list[tuple[float, str, int]] = []  # max-heap on next use (negated)
        self._held_blocks = 0

    def hold(self, following: TraceTurn, blocks: int, tokens: int) -> None:
        """Keep the KV that ``following`` would reuse, then drop what no longer fits."""
        self._held[(following.session, following.turn)] = (blocks, tokens)
        self._held_blocks += blocks
        heapq.heappush(self._furthest, (-following.start_s, following.session, following.turn))
        self.fit()

    def take(self, turn: TraceTurn) -> int | None:
        """The tokens held for ``turn``, whose blocks it now serves from; None if not held."""
        kept = self._held.pop((turn.session, turn.turn), None)
        if kept is None:
            return None
        self._held_blocks -= kept[0]
        return kept[1]

    def fit(self) -> None:
        """Drop the holdings used furthest in the future until everything fits."""
        while self.active + self._held_blocks > self.capacity and self._furthest:
            _, session, turn = heapq.heappop(self._furthest)
            kept = self._held.pop((session, turn), None)
            if kept is not None:
                self._held_blocks -= kept[0]
