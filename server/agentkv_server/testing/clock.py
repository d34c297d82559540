"""A clock a test moves by hand, for the router's parts that take one (or patch one in)."""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
    """Seconds that pass only when the test sets ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
