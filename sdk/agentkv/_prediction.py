"""Predicts how long a session's tool step takes, i.e. the seconds until its next model call.

The router uses the prediction to decide how long a decode engine keeps the session's KV cache
(docs/protocol.md section 2): too short and a slow tool loop loses its prefix, too long and a
finished session wastes decode memory.
"""

from __future__ import annotations

from typing import Final

__all__ = ["NextTurnPredictor"]

TOOL_CALLS: Final = "tool_calls"


class NextTurnPredictor:
    """Exponentially weighted mean of the gaps between a ``tool_calls`` response and the next call.

    Not thread-safe: the owning session serialises access.
    """

    def __init__(self, *, alpha: float = 0.5, initial_seconds: float | None = None) -> None:
        self._alpha = alpha
        self._seconds = initial_seconds
        self._tool_step_started: float | None = None

    @property
    def seconds(self) -> float | None:
        """The current prediction, or ``None`` before any sample."""
        return self._seconds

    def response_ended(self, finish_reason: str | None, at: float) -> None:
        """A response's last byte arrived at ``at``; a ``tool_calls`` ending starts a tool step."""
        self._tool_step_started = at if finish_reason == TOOL_CALLS else None

    def call_started(self, at: float) -> None:
        """A model call starts at ``at``: it ends the running tool step, if any."""
        if self._tool_step_started is not None:
            self.add(max(0.0, at - self._tool_step_started))

    def add(self, seconds: float) -> None:
        """Feeds one measured tool step.

        An explicit measurement replaces the gap this predictor would otherwise measure for the
        running tool step, so that one step is never counted twice.
        """
        self._tool_step_started = None
        if self._seconds is None:
            self._seconds = seconds
        else:
            self._seconds = self._alpha * seconds + (1 - self._alpha) * self._seconds
