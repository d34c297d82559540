"""How long each request waited for KV blocks before the scheduler admitted it, and how much of
that wait fell while the engine retained finished requests' blocks for later pulls.

vLLM's own ``vllm:request_queue_time_seconds`` is one histogram per engine: it mixes a wait for
blocks with a wait for a batch slot, and cannot say whose blocks were in the way. Here a step
is *short* when the scheduler asked the connector about a request (it does once per attempt to
admit one, ``get_num_new_matched_tokens``) and did not admit it: vLLM admits in queue order and
stops at the first request it cannot allocate blocks for. Every request still waiting then
waits for blocks until the next step, the ones queued behind that first request included. The
part of such a wait during which the engine retained blocks that were neither released nor
expired is the wait retained KV caused: had those holdings yielded, the request would have run
(docs/connector.md, "Waits for blocks").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BlockWait", "BlockWaits"]


@dataclass
class BlockWait:
    """Seconds a request waited for blocks, and those of them beside retained blocks."""

    seconds: float = 0.0
    beside_retained_s: float = 0.0


class BlockWaits:
    """Per-request waits for blocks, accounted once per scheduler step (``step``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._unadmitted: set[str] = set()
        self._asked: set[str] = set()  # asked about this step and not admitted
        self._waits: dict[str, BlockWait] = {}
        # What the previous step found: the requests left waiting for blocks (none when it
        # was not short), whether holdings were in their way, and when.
        self._short: frozenset[str] = frozenset()
        self._retaining = False
        self._stepped_at = clock()

    def arrived(self, req_id: str) -> None:
        self._unadmitted.add(req_id)

    def asked(self, req_id: str) -> None:
        if req_id in self._unadmitted:
            self._asked.add(req_id)

    def admitted(self, req_id: str) -> None:
        self._unadmitted.discard(req_id)
        self._asked.discard(req_id)

    def step(self, retaining: Callable[[], bool]) -> None:
        """One scheduler step was planned: charge the interval since the previous one to the
        requests that step left waiting for blocks, and note who waits now. ``retaining`` is
        asked only on a short step."""
        now = self._clock()
        interval = now - self._stepped_at
        for req_id in self._short:
            wait = self._waits.setdefault(req_id, BlockWait())
            wait.seconds += interval
            if self._retaining:
                wait.beside_retained_s += interval
        short = bool(self._asked)
        self._asked.clear()
        self._short = frozenset(self._unadmitted) if short else frozenset()
        self._retaining = short and retaining()
        self._stepped_at = now

    def finished(self, req_id: str) -> BlockWait | None:
        """The request's wait (None when it never waited for blocks); forgets it."""
        self._unadmitted.discard(req_id)
        self._asked.discard(req_id)
        if req_id in self._short:  # aborted while it waited: nothing more to charge
            self._short = self._short - {req_id}
        return self._waits.pop(req_id, None)
