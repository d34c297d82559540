"""Reuse policies: pull a session's held KV or recompute it, and how long to retain it after.

``agentkv`` (:class:`CostModelPolicy`) compares the predicted time to pull the held tokens from
the decode holder with the time to recompute them on a prefill engine, from rates the router
measures on its own prefill steps (exponentially weighted line fits), and skips holdings that would
expire before the pull is done. It asks decode engines to retain KV for as long as the client's
hints say the next turn is away. ``upstream`` imitates vLLM's example proxy (a fixed 64-token
threshold, the engines' fixed 480 s retention, no hints) and ``never`` always recomputes and
asks engines to keep nothing: the benchmark's modes ``upstream`` and ``recompute``. ``always``
pulls every holding that will not expire first, whatever it costs (retention as ``agentkv``):
for tests of the KV path, and for operators who know pulling wins on their hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agentkv_server.router.intake import TurnHints
from agentkv_server.router.sessions import Holding
from agentkv_server.settings import CostModelSettings, PolicyName, RetentionSettings, Settings

__all__ = [
    "AlwaysPolicy",
    "CostModelPolicy",
    "Decision",
    "LinearFit",
    "NeverPolicy",
    "PrefillSample",
    "ReusePolicy",
    "UpstreamPolicy",
    "make_policy",
]

# Seconds per token never learned below this: a pull that looked free must not make every
# later pull look free.
_MIN_SECONDS_PER_TOKEN = 1e-7


@dataclass(frozen=True)
class Decision:
    """Whether to pull a holding, and why (for logs and tests)."""

    reuse: bool
    reason: str


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill step: tokens computed, tokens pulled from a holder, its duration."""

    computed_tokens: int
    pulled_tokens: int
    seconds: float


class ReusePolicy(Protocol):
    name: PolicyName
    sends_hints: bool
    """Whether decode engines get agentkv's own ``kv_transfer_params`` (retention, ticket,
    release). False for engines that only speak upstream's protocol."""

    def decide(self, holding: Holding, now: float) -> Decision: ...

    def retention_s(self, hints: TurnHints) -> float:
        """Seconds the decode engine should keep this turn's KV after it finishes."""

    def observe(self, sample: PrefillSample) -> None: ...


class LinearFit:
    """``seconds = intercept + slope * tokens``, fitted by exponentially weighted least squares.

    The prior (from the settings) is the whole line until a measurement arrives; after that it
    stays only as a lightly weighted point at zero tokens, which anchors the fixed cost when
    the measurements lack spread (all at one size). Measurements carry a total weight near 1
    that favours recent ones, so they soon dominate.
    """

    _ANCHOR_WEIGHT = 0.05

    def __init__(self, intercept: float, slope: float, alpha: float) -> None:
        self._prior = (intercept, slope)
        self._alpha = alpha
        self._sums = [0.0] * 5  # sums of w, w*x, w*x*x, w*y, w*x*y over measurements

    def add(self, tokens: float, seconds: float) -> None:
        self._sums = [(1 - self._alpha) * total for total in self._sums]
        _accumulate(self._sums, tokens, seconds, self._alpha)

    def line(self) -> tuple[float, float]:
        """(intercept, slope), both clipped to stay physical."""
        if self._sums[0] == 0.0:
            return self._prior
        anchored = list(self._sums)
        _accumulate(anchored, 0.0, self._prior[0], self._ANCHOR_WEIGHT)
        w, wx, wxx, wy, wxy = anchored
        slope = max((w * wxy - wx * wy) / (w * wxx - wx * wx), _MIN_SECONDS_PER_TOKEN)
        return max((wy - slope * wx) / w, 0.0), slope


def _accumulate(sums: list[float], x: float, y: float, weight: float) -> None:
    for index, term in enumerate((1.0, x, x * x, y, x * y)):
        sums[index] += weight * term


class CostModelPolicy:
    """Reuse when pulling the held tokens is predicted to beat recomputing them.

    Prefill steps that pulled nothing fit ``seconds = fixed + per_token * computed``; steps that
    pulled fit the rest of their time, ``seconds - fixed - per_token * computed``, as
    ``overhead + per_pulled_token * pulled``. A reuse saves recomputing the held tokens and
    costs pulling them; the fixed part of a prefill step is paid either way.
    """

    name: PolicyName = "agentkv"
    sends_hints = True

    def __init__(self, cost: CostModelSettings, retention: RetentionSettings) -> None:
        self._cost = cost
        self._retention = retention
        self._prefill = LinearFit(0.0, 1.0 / cost.prefill_tokens_per_s, cost.ewma_alpha)
        self._pull = LinearFit(cost.pull_overhead_s, 1.0 / cost.pull_tokens_per_s, cost.ewma_alpha)

    @property
    def prefill_s_per_token(self) -> float:
        return self._prefill.line()[1]

    def predicted_pull_s(self, tokens: int) -> float:
        overhead, per_token = self._pull.line()
        return overhead + tokens * per_token

    def predicted_recompute_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def decide(self, holding: Holding, now: float) -> Decision:
        pull_s = self.predicted_pull_s(holding.num_tokens)
        if holding.remaining_s(now) < pull_s + self._cost.expiry_guard_s:
            return Decision(False, "expiring")
        if pull_s >= self.predicted_recompute_s(holding.num_tokens):
            return Decision(False, "recompute_cheaper")
        return Decision(True, "pull_cheaper")

    def retention_s(self, hints: TurnHints) -> float:
        retention = self._retention
        if hints.session_end:
            return 0.0
        if hints.next_turn_seconds is None:
            return retention.default_s
        asked = hints.next_turn_seconds * retention.factor + retention.slack_s
        return min(max(asked, retention.min_s), retention.max_s)

    def observe(self, sample: PrefillSample) -> None:
        floor = self._cost.min_sample_tokens
        if sample.pulled_tokens == 0 and sample.computed_tokens >= floor:
            self._prefill.add(sample.computed_tokens, sample.seconds)
        elif sample.pulled_tokens >= floor:
            fixed, per_token = self._prefill.line()
            pull_s = sample.seconds - fixed - per_token * sample.computed_tokens
            self._pull.add(sample.pulled_tokens, max(pull_s, 0.0))


class AlwaysPolicy(CostModelPolicy):
    """Pull every holding that outlives the expiry guard; retain as the cost model does."""

    name: PolicyName = "always"

    def decide(self, holding: Holding, now: float) -> Decision:
        if holding.remaining_s(now) < self._cost.expiry_guard_s:
            return Decision(False, "expiring")
        return Decision(True, "always")


class UpstreamPolicy:
    """vLLM's example proxy: reuse from 64 held tokens, engines keep KV their fixed 480 s."""

    name: PolicyName = "upstream"
    sends_hints = False
    THRESHOLD_TOKENS = 64
    RETENTION_S = 480.0

    def decide(self, holding: Holding, now: float) -> Decision:
        if holding.num_tokens < self.THRESHOLD_TOKENS:
            return Decision(False, "below_threshold")
        return Decision(True, "threshold")

    def retention_s(self, hints: TurnHints) -> float:
        return self.RETENTION_S

    def observe(self, sample: PrefillSample) -> None:
        return None


class NeverPolicy:
    """Always recompute, and ask engines to free each turn's KV at once."""

    name: PolicyName = "never"
    sends_hints = True

    def decide(self, holding: Holding, now: float) -> Decision:
        return Decision(False, "disabled")

    def retention_s(self, hints: TurnHints) -> float:
        return 0.0

    def observe(self, sample: PrefillSample) -> None:
        return None


def make_policy(settings: Settings) -> ReusePolicy:
    """The policy the settings name."""
    if settings.policy == "upstream":
        return UpstreamPolicy()
    if settings.policy == "never":
        return NeverPolicy()
    if settings.policy == "always":
        return AlwaysPolicy(settings.cost, settings.retention)
    return CostModelPolicy(settings.cost, settings.retention)
