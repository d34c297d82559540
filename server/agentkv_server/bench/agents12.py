"""Issue 48's twelve agent sessions (``agentkv bench --preset agents12``), as the issue ran them:
12 streamed sessions of about 2.7k tokens of initial history, 5 turns of 100 new words and 16
output tokens each, started 3 s apart, on the engines ``agentkv serve`` starts with its defaults,
through clients with openai's default retries (2).

Tool gaps come in three kinds, and the sessions take them in turn (session i is of kind
``KINDS[i % 3]``: 4 of each of 12): ``fast``, 2 s between turns; ``slow``, 16 s; ``idle``, 2 s
between turns like ``fast``, but after its last turn the session goes idle without announcing
its end, as an agent whose user walked away (``fast`` and ``slow`` sessions announce it on their
last turn). Taking kinds in turn spreads each over the start times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from agentkv_server.bench.planned import PlannedSession, Point
from agentkv_server.bench.pressure import SessionPlan
from agentkv_server.errors import ConfigError

__all__ = ["KINDS", "AgentSessions"]

KINDS: Final = ("fast", "slow", "idle")
_TAG: Final = "agents12"


@dataclass(frozen=True)
class AgentSessions:
    """The sessions of issue 48's run. ``history_tokens`` is each session's initial history in
    the served model's tokens; a turn's fresh input is ``new_words`` words."""

    sessions: int = 12
    history_tokens: int = 2700
    turns: int = 5
    new_words: int = 100
    output_tokens: int = 16
    fast_gap_s: float = 2.0
    slow_gap_s: float = 16.0
    start_every_s: float = 3.0
    seed: int = 0
    """Seed of the texts the sessions send."""

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.new_words, self.output_tokens) < 1:
            raise ConfigError("agents12: sessions, turns, new words and output tokens >= 1")
        if self.history_tokens < 0 or min(self.fast_gap_s, self.slow_gap_s) < 0:
            raise ConfigError("agents12: history tokens and tool gaps must be >= 0")
        if self.start_every_s < 0:
            raise ConfigError("agents12: sessions start >= 0 s apart")

    def kind(self, index: int) -> str:
        return KINDS[index % len(KINDS)]

    def planned(self) -> tuple[PlannedSession, ...]:
        return tuple(self._session(index) for index in range(self.sessions))

    def point(self) -> Point:
        """The one point of the preset: every session."""
        return Point(_TAG, self.planned())

    def _session(self, index: int) -> PlannedSession:
        kind = self.kind(index)
        gap = self.slow_gap_s if kind == "slow" else self.fast_gap_s
        plan = SessionPlan(
            index,
            self.history_tokens,
            index * self.start_every_s,
            (gap,) * (self.turns - 1),
            ends=kind != "idle",
        )
        return PlannedSession(plan, kind, f"{kind}{index}")

    def with_overrides(self, **fields: object) -> AgentSessions:
        """A copy with the fields given (None: keep)."""
        given = {name: value for name, value in fields.items() if value is not None}
        return replace(self, **given)  # type: ignore[arg-type]

    def describe(self) -> str:
        counts = {kind: sum(self.kind(i) == kind for i in range(self.sessions)) for kind in KINDS}
        return (
            f"{self.sessions} streamed agent sessions started {self.start_every_s:g} s apart, "
            f"{self.history_tokens} tokens of initial history, {self.turns} turns of "
            f"{self.new_words} new words and {self.output_tokens} output tokens; tool gaps "
            f"fast {self.fast_gap_s:g} s ({counts['fast']} sessions), slow {self.slow_gap_s:g} "
            f"s ({counts['slow']}), idle ({counts['idle']}: fast gaps, then idle without "
            "announcing the end); clients retry as openai's do (2 retries)"
        )
