"""The memory-pressure workload (``agentkv bench --preset pressure``): more sessions than one
decode engine's KV cache can hold between their turns.

Each sweep point runs ``count`` sessions at once. Every session draws its own initial history
(uniform in ``history_tokens``), its number of turns and heavy-tailed tool gaps (lognormal,
capped at 30 medians), and starts at a random moment of the first ten median gaps; a share of them
(``idle_share``) go idle after their last turn without announcing the end, as an agent whose user
walked away does. Their history together exceeds the decode engine's KV cache from a few
sessions on, so a retention policy has to choose what to keep: the report sets each mode's reuse
beside the clairvoyant's (bench/clairvoyant.py).

Everything is drawn from the seed and the session's index, never from the mode, so every mode
sends the same sessions; ``count`` only says how many of them run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from agentkv_server.errors import ConfigError

__all__ = ["PressureWorkload", "SessionPlan"]


@dataclass(frozen=True)
class SessionPlan:
    """One session of a run as it will be sent: its initial history, when it starts, the tool
    gaps before turns 2..N, and whether its last turn says that the session ends."""

    index: int
    history_tokens: int
    start_s: float
    gaps_s: tuple[float, ...]
    ends: bool = True

    @property
    def turns(self) -> int:
        return len(self.gaps_s) + 1


@dataclass(frozen=True)
class PressureWorkload:
    """Shape of the pressure sweep: ``session_counts`` sessions at once per sweep point, each
    with ``history_tokens[0]``..``history_tokens[1]`` tokens of initial history and
    ``turns[0]``..``turns[1]`` turns of ``new_tokens`` in and ``output_tokens`` out."""

    session_counts: tuple[int, ...]
    history_tokens: tuple[int, int]
    turns: tuple[int, int]
    new_tokens: int
    output_tokens: int
    gap_median_s: float = 2.0
    gap_sigma: float = 1.5
    """Tool gaps are lognormal: median ``gap_median_s``, shape ``gap_sigma`` (1.5: one gap in
    ten is over 6.8 times the median, one in a hundred over 33 times)."""
    idle_share: float = 0.25
    seed: int = 0
    start_spread_s: float | None = None
    """Sessions start within this many seconds (None: ten median gaps), as agents arriving, not
    all in one instant: their cold first turns queue on the prefill engine."""

    @property
    def max_gap_s(self) -> float:
        """Cap of one tool gap, 30 medians: the tail stays heavy, the run bounded."""
        return 30 * self.gap_median_s

    @property
    def start_window_s(self) -> float:
        return self.start_spread_s if self.start_spread_s is not None else 10 * self.gap_median_s

    def __post_init__(self) -> None:
        low, high = self.history_tokens
        if not self.session_counts or min(self.session_counts) < 1:
            raise ConfigError("pressure: session counts must be >= 1")
        if not 0 <= low <= high or not 1 <= self.turns[0] <= self.turns[1]:
            raise ConfigError("pressure: history tokens and turns are LOW,HIGH ranges")
        if min(self.new_tokens, self.output_tokens) < 1 or not 0 <= self.idle_share <= 1:
            raise ConfigError("pressure: new/output tokens must be >= 1, idle share in 0..1")
        if min(self.gap_median_s, self.gap_sigma) <= 0:
            raise ConfigError("pressure: the tool gaps' median and sigma must be > 0")
        if self.start_spread_s is not None and self.start_spread_s < 0:
            raise ConfigError("pressure: the start spread must be >= 0 seconds")

    def sessions(self, count: int) -> tuple[SessionPlan, ...]:
        """The first ``count`` sessions; session i is the same in every sweep point it is in."""
        return tuple(self._session(index) for index in range(count))

    def _session(self, index: int) -> SessionPlan:
        rng = random.Random(f"{self.seed}:pressure:{index}")
        history = rng.randint(*self.history_tokens)
        turns = rng.randint(*self.turns)
        start = rng.uniform(0.0, self.start_window_s)
        gaps = tuple(
            min(rng.lognormvariate(math.log(self.gap_median_s), self.gap_sigma), self.max_gap_s)
            for _ in range(turns - 1)
        )
        return SessionPlan(index, history, start, gaps, ends=rng.random() >= self.idle_share)

    def with_overrides(
        self,
        *,
        session_counts: tuple[int, ...] | None = None,
        history_tokens: tuple[int, ...] | None = None,
        turns: int | None = None,
        new_tokens: int | None = None,
        output_tokens: int | None = None,
        gap_median_s: float | None = None,
        start_spread_s: float | None = None,
        seed: int | None = None,
    ) -> PressureWorkload:
        """A copy with the command line's values where given: ``history_tokens`` as LOW,HIGH
        (one value: every session that long), ``turns`` the most turns of a session."""
        fields: dict[str, object] = {}
        if session_counts is not None:
            fields["session_counts"] = session_counts
        if history_tokens is not None:
            if len(history_tokens) not in (1, 2):
                raise ConfigError("--preset pressure: --history-tokens is LOW,HIGH")
            fields["history_tokens"] = (history_tokens[0], history_tokens[-1])
        if turns is not None:
            fields["turns"] = (min(self.turns[0], turns), turns)
        given = {"new_tokens": new_tokens, "output_tokens": output_tokens,
                 "gap_median_s": gap_median_s, "start_spread_s": start_spread_s,
                 "seed": seed}  # fmt: skip
        for name, value in given.items():
            if value is not None:
                fields[name] = value
        return replace(self, **fields)  # type: ignore[arg-type]

    def describe(self) -> str:
        low, high = self.history_tokens
        return (
            f"{', '.join(map(str, self.session_counts))} sessions at once (one run each), "
            f"starting within {self.start_window_s:g} s; {low}-{high} tokens of initial history "
            f"and {self.turns[0]}-{self.turns[1]} turns per session, {self.new_tokens} new and "
            f"{self.output_tokens} output tokens per turn; tool gaps lognormal, median "
            f"{self.gap_median_s:g} s, sigma {self.gap_sigma:g}, at most {self.max_gap_s:g} s; "
            f"{self.idle_share:.0%} of sessions go idle without ending"
        )
