"""Which turns the router takes on when its prefill engines cannot keep up with them.

Every turn that needs a prefill step is accepted or refused as it arrives, never after it has
waited: its wait is predicted on the prefill engine that would start it soonest (the work in
flight there and the turns held back ahead of it: queue.StepQueue), and a turn predicted to wait
longer than ``admission.max_wait_s`` is refused with 503 and ``Retry-After``, its session's
holding kept for its next try. An accepted turn waits its turn: a busy engine is not a failed one
(docs/router.md, "Admission").

A follow-up of a session that has run before goes before a new session's first turn
(:class:`~agentkv_server.router.queue.Priority`): its agent is waiting, its history is usually
held, and a session cut off halfway wastes what it already cost. Local turns need no prefill
engine and are never held or refused here.
"""

from __future__ import annotations

import math

from agentkv_server.router.errors import RouterError
from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.placement import EnginePool
from agentkv_server.router.queue import Priority
from agentkv_server.settings import AdmissionSettings

__all__ = ["Admission", "Overloaded", "priority_of"]

# Retry-After is at most this: the openai client honours up to 60 s (2 min in openai 2.x) and
# gives up at once beyond it; a queue's prediction this far out is rough anyway.
_MAX_RETRY_AFTER_S = 60


class Overloaded(RouterError):
    """A turn refused as it arrived: the prefill engines' queue is longer than the router
    accepts. 503 with ``Retry-After`` (whole seconds), which the openai client honours."""

    def __init__(self, wait_s: float, max_wait_s: float, headers: dict[str, str]) -> None:
        retry_after = min(max(math.ceil(wait_s - max_wait_s), 1), _MAX_RETRY_AFTER_S)
        super().__init__(
            503,
            f"The server is overloaded: this turn would wait about {wait_s:.0f} s for a "
            f"prefill engine (the limit is {max_wait_s:g} s). Retry after {retry_after} s.",
            type="server_error",
            code="overloaded",
            headers={**headers, "retry-after": str(retry_after), "x-should-retry": "true"},
        )
        self.retry_after_s = retry_after


def priority_of(request: ClientRequest, had_holding: bool) -> Priority:
    """A follow-up when the session has run before: it had a holding (``had_holding``, kept
    or released for room), or the client numbers this turn past its first or says it follows
    a tool call."""
    if request.session_key is None:
        return Priority.NEW
    hints = request.hints
    follows = had_holding or hints.tool_continuation or (hints.turn or 1) > 1
    return Priority.FOLLOW_UP if follows else Priority.NEW


class Admission:
    """Accepts or refuses turns by their predicted wait for a prefill engine."""

    def __init__(
        self, settings: AdmissionSettings, prefill: EnginePool, metrics: RouterMetrics
    ) -> None:
        self._settings = settings
        self._prefill = prefill
        self._metrics = metrics

    def wait_s(self, tokens: int, priority: Priority, tenant: str | None) -> float:
        """The shortest predicted wait, over healthy prefill engines, for a step of ``tokens``
        (0 without any: the decode engine computes the prompt then)."""
        waits = [
            engine.queue.wait_s(tokens, priority, tenant)
            for engine in self._prefill.engines
            if engine.healthy
        ]
        return min(waits, default=0.0)

    def admit(
        self, request: ClientRequest, priority: Priority, tokens: int, headers: dict[str, str]
    ) -> None:
        """Refuse the turn (:class:`Overloaded`, with ``headers``) when it would wait longer
        than ``max_wait_s``."""
        if not self._settings.enabled:
            return
        wait_s = self.wait_s(tokens, priority, request.tenant)
        if wait_s <= self._settings.max_wait_s:
            return
        self._metrics.record_refused(priority.label, request.tenant)
        raise Overloaded(wait_s, self._settings.max_wait_s, headers)
