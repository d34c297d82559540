"""A line fitted to measurements as they come, for the router's cost predictions."""

from __future__ import annotations

__all__ = ["LinearFit"]

# Seconds per token never learned below this: a pull that looked free must not make every
# later pull look free.
_MIN_SECONDS_PER_TOKEN = 1e-7


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
        spread = w * wxx - wx * wx
        if spread <= 0.0:  # every measurement at zero tokens, as the anchor: no slope to fit
            slope = self._prior[1]
        else:
            slope = max((w * wxy - wx * wy) / spread, _MIN_SECONDS_PER_TOKEN)
        return max((wy - slope * wx) / w, 0.0), slope


def _accumulate(sums: list[float], x: float, y: float, weight: float) -> None:
    for index, term in enumerate((1.0, x, x * x, y, x * y)):
        sums[index] += weight * term
