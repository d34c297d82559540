"""The overload workload (``agentkv bench --preset overload``): bursts of new sessions arriving
beside sessions already running, at multiples of what the stack serves.

Two tenants, each with its own API key on the modes' routers. The *steady* tenant runs a few
sessions from the start of a run to its end, a turn every few seconds: the sessions already
running. The *bursting* tenant sends ``bursts`` bursts, one every ``burst_period_s`` from
``lead_in_s`` on (by then the steady sessions' first turns are done); a burst is N new sessions
arriving within ``burst_window_s``, each a few turns long. Tool gaps are lognormal (heavy-
tailed), capped at ten medians so that a run stays a few minutes long.

N follows the offered load: at load L, a burst period's work (its burst's sessions' and the
steady tenant's) is L times what the stack computes in that time, its measured capacity
(bench/capacity.py). Work is counted in the prompt tokens a stack that reuses history must
compute: a session's first turn its whole prompt, a follow-up its fresh input and the previous
answer. Load 0 is the steady tenant alone, the point its follow-ups are compared with.

Everything is drawn from the seed and a session's place (steady session i; burst b's session j),
never from the mode or the load: burst b's first N sessions are the same at every load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from agentkv_server.bench.planned import PlannedSession, Point
from agentkv_server.bench.pressure import SessionPlan
from agentkv_server.errors import ConfigError
from agentkv_server.settings import Settings

__all__ = [
    "BURST",
    "STEADY",
    "TENANT_KEYS",
    "OverloadWorkload",
    "router_settings",
]

STEADY: Final = "steady"
BURST: Final = "burst"
# Each tenant's API key on the modes' routers (keys must be at least 16 characters).
TENANT_KEYS: Final = {STEADY: "agentkv-bench-steady-tenant", BURST: "agentkv-bench-burst-tenant"}
# Burst b's session j is session (b + 1) * _BURST_STRIDE + j; the steady sessions are 0, 1, ...
_BURST_STRIDE: Final = 1000
# One tool gap is at most this many medians.
_GAP_CAP: Final = 10
# Seconds a client waits for a try beyond the routers' own deadline for a turn.
_CLIENT_SLACK_S: Final = 10.0


@dataclass(frozen=True)
class OverloadWorkload:
    """Shape of the overload preset: a run per offered load in ``loads`` (x capacity; 0: the
    steady tenant alone), ``objective_s`` the TTFT a turn must be answered within to count as
    goodput (and the routers' admission bound), ``turn_timeout_s`` the deadline of a turn that
    was accepted (:func:`router_settings`, :attr:`client_timeout_s`)."""

    loads: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0)
    objective_s: float = 30.0
    turn_timeout_s: float = 120.0
    history_tokens: tuple[int, int] = (1000, 2000)
    new_tokens: int = 100
    output_tokens: int = 16
    turns: tuple[int, int] = (2, 4)
    """Turns of a bursting session, drawn per session."""
    bursts: int = 3
    burst_period_s: float = 40.0
    burst_window_s: float = 5.0
    lead_in_s: float = 20.0
    gap_median_s: float = 2.0
    gap_sigma: float = 1.0
    """Lognormal shape of every tool gap (1.0: one gap in a hundred over ten medians)."""
    steady_sessions: int = 2
    steady_gap_median_s: float = 4.0
    calibration_turns: int = 5
    """Cold turns sent one after another to measure the capacity."""
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = self.history_tokens
        if not self.loads or min(self.loads) < 0:
            raise ConfigError("overload: loads must be >= 0 (0: the steady tenant alone)")
        if not 0 <= low <= high or not 1 <= self.turns[0] <= self.turns[1]:
            raise ConfigError("overload: history tokens and turns are LOW,HIGH ranges")
        if min(self.new_tokens, self.output_tokens, self.bursts, self.calibration_turns) < 1:
            raise ConfigError("overload: tokens, bursts and calibration turns must be >= 1")
        positive = (self.objective_s, self.burst_period_s, self.gap_median_s, self.gap_sigma,
                    self.steady_gap_median_s, self.turn_timeout_s)  # fmt: skip
        if min(positive) <= 0 or min(self.lead_in_s, self.burst_window_s) < 0:
            raise ConfigError("overload: objective, period and gaps > 0 s; lead-in, window >= 0")
        if self.burst_window_s > self.burst_period_s or self.steady_sessions < 1:
            raise ConfigError("overload: a burst arrives within its period; >= 1 steady session")

    @property
    def client_timeout_s(self) -> float:
        """How long a client waits for a try: a little past the routers' deadline, so that a
        turn a router gives up on shows as its 504 (not retried), not as the client's timeout
        (which openai retries); ``aggregated``, which has no router, meets the client's."""
        return self.turn_timeout_s + _CLIENT_SLACK_S

    @property
    def window_s(self) -> float:
        """The offered window: the lead-in and every burst period. Goodput counts the turns
        answered within the objective inside it; the steady sessions run through it."""
        return self.lead_in_s + self.bursts * self.burst_period_s

    def work_tokens(self, plan: SessionPlan) -> int:
        """Prompt tokens a reusing stack computes for the session (the module's docstring)."""
        first = plan.history_tokens + self.new_tokens
        return first + (plan.turns - 1) * (self.new_tokens + self.output_tokens)

    @property
    def mean_burst_work(self) -> float:
        """A bursting session's expected work (history and turns uniform in their ranges)."""
        history = sum(self.history_tokens) / 2
        followups = sum(self.turns) / 2 - 1
        return history + self.new_tokens + followups * (self.new_tokens + self.output_tokens)

    def steady(self) -> tuple[PlannedSession, ...]:
        """The steady tenant's sessions: started in the lead-in's first half, turns until the
        offered window ends; their last turn says the session ends."""
        return tuple(self._steady(index) for index in range(self.steady_sessions))

    def steady_tokens_per_s(self) -> float:
        """The steady tenant's work per second of the offered window."""
        return sum(self.work_tokens(s.plan) for s in self.steady()) / self.window_s

    def burst_size(self, load: float, capacity_tokens_per_s: float) -> int:
        """Sessions per burst at ``load`` (at least one above load 0)."""
        if load == 0:
            return 0
        room = (load * capacity_tokens_per_s - self.steady_tokens_per_s()) * self.burst_period_s
        return max(1, round(room / self.mean_burst_work))

    def sessions(self, load: float, capacity_tokens_per_s: float) -> tuple[PlannedSession, ...]:
        """Every session of the run at ``load``: the steady ones, then each burst's."""
        size = self.burst_size(load, capacity_tokens_per_s)
        if size >= _BURST_STRIDE:
            raise ConfigError(f"overload: {size} sessions a burst; at most {_BURST_STRIDE - 1}")
        bursts = (self._burst(b, j) for b in range(self.bursts) for j in range(size))
        return (*self.steady(), *bursts)

    def points(self, capacity_tokens_per_s: float) -> tuple[Point, ...]:
        """A run's sessions per offered load, in the order of ``loads``."""
        points = []
        for load in self.loads:
            sessions = self.sessions(load, capacity_tokens_per_s)
            points.append(
                Point(
                    f"x{load:g}",
                    sessions,
                    load,
                    self.burst_size(load, capacity_tokens_per_s),
                    round(self.offered_tokens_per_s(sessions), 1),
                )
            )
        return tuple(points)

    def offered_tokens_per_s(self, sessions: tuple[PlannedSession, ...]) -> float:
        """What the drawn sessions offer: the bursts' work per burst period, and the steady
        tenant's per second of the window (the sizing's terms, with the draws' own sizes)."""
        burst = sum(self.work_tokens(s.plan) for s in sessions if s.label == BURST)
        return self.steady_tokens_per_s() + burst / (self.bursts * self.burst_period_s)

    def _steady(self, index: int) -> PlannedSession:
        rng = random.Random(f"{self.seed}:steady:{index}")
        start = index * self.lead_in_s / (2 * self.steady_sessions)
        gaps: list[float] = []
        at = start
        while at < self.window_s:
            gaps.append(self._gap(rng, self.steady_gap_median_s))
            at += gaps[-1]
        plan = SessionPlan(index, rng.randint(*self.history_tokens), start, tuple(gaps))
        return PlannedSession(plan, STEADY, f"{STEADY}{index}", TENANT_KEYS[STEADY])

    def _burst(self, burst: int, index: int) -> PlannedSession:
        rng = random.Random(f"{self.seed}:burst:{burst}:{index}")
        history = rng.randint(*self.history_tokens)
        turns = rng.randint(*self.turns)
        start = self.lead_in_s + burst * self.burst_period_s + rng.uniform(0, self.burst_window_s)
        gaps = tuple(self._gap(rng, self.gap_median_s) for _ in range(turns - 1))
        plan = SessionPlan((burst + 1) * _BURST_STRIDE + index, history, start, gaps)
        return PlannedSession(plan, BURST, f"b{burst}s{index}", TENANT_KEYS[BURST], burst)

    def _gap(self, rng: random.Random, median_s: float) -> float:
        drawn = rng.lognormvariate(math.log(median_s), self.gap_sigma)
        return min(drawn, _GAP_CAP * median_s)

    def with_overrides(self, **fields: object) -> OverloadWorkload:
        """A copy with the fields given (None: keep); ``history_tokens`` and ``turns`` as
        LOW,HIGH (one value: that much for every bursting session)."""
        given = {name: value for name, value in fields.items() if value is not None}
        for name in ("history_tokens", "turns"):
            if name in given:
                values = tuple(given[name])  # type: ignore[call-overload]
                if len(values) not in (1, 2):
                    raise ConfigError(f"--preset overload: --{name.replace('_', '-')} is LOW,HIGH")
                given[name] = (values[0], values[-1])
        return replace(self, **given)  # type: ignore[arg-type]

    def describe(self) -> str:
        low, high = self.history_tokens
        return (
            f"offered loads {', '.join(f'{load:g}x' for load in self.loads)} of the measured "
            f"capacity (0x: the steady tenant alone); TTFT objective {self.objective_s:g} s "
            f"(also the routers' admission bound), an accepted turn's deadline "
            f"{self.turn_timeout_s:g} s; {self.steady_sessions} steady session(s), a "
            f"turn every {self.steady_gap_median_s:g} s (median) for {self.window_s:g} s; "
            f"{self.bursts} bursts of new sessions {self.burst_period_s:g} s apart from "
            f"{self.lead_in_s:g} s on, each within {self.burst_window_s:g} s, {self.turns[0]}-"
            f"{self.turns[1]} turns per session, gaps median {self.gap_median_s:g} s; "
            f"{low}-{high} tokens of initial history, {self.new_tokens} new and "
            f"{self.output_tokens} output tokens per turn; tool gaps lognormal, sigma "
            f"{self.gap_sigma:g}, at most {_GAP_CAP} medians"
        )


def router_settings(base: Mapping[str, Any], workload: OverloadWorkload) -> dict[str, Any]:
    """The modes' router settings for the preset: ``base`` (the ``AGENTKV_*`` variables) with
    each tenant's key, the turn timeout as the routers' deadline for a turn
    (``timeouts.first_token_s``) and, on a router with admission control, the objective as its
    admission bound (a turn predicted to wait longer is refused as it arrives)."""
    timeouts = {**base.get("timeouts", {}), "first_token_s": workload.turn_timeout_s}
    settings = {**base, "api_keys": list(TENANT_KEYS.values()), "timeouts": timeouts}
    if "admission" in Settings.model_fields:
        settings["admission"] = {**base.get("admission", {}), "max_wait_s": workload.objective_s}
    return settings
