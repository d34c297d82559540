"""Waits for KV blocks that engines report per request (the connector's ``blockwaits.py``),
counted once per request in ``agentkv_engine_blocks_wait_seconds{role,beside}``.

``beside="retained"``: part of the wait fell while the engine retained blocks for later pulls
that were neither released nor expired, so holdings kept a live request out (what the router's
capacity ledger exists to prevent: docs/router.md, "Capacity"); ``"running"``: only the running
requests' blocks were in the way. Engines with another connector report nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from agentkv_server import wire

if TYPE_CHECKING:  # metrics.py takes this module's METRIC
    from agentkv_server.router.metrics import RouterMetrics
    from agentkv_server.router.placement import Role

__all__ = ["METRIC", "BlockWaitTally"]

METRIC = "agentkv_engine_blocks_wait_seconds"

# Requests whose wait was counted, remembered so that the same params seen twice (a streamed
# decode step's answer and its holding report) count once.
_REMEMBERED = 4096


class BlockWaitTally:
    """Takes each request's wait for blocks out of its returned params and counts it once."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._counted: OrderedDict[tuple[Role, str], None] = OrderedDict()

    def record(self, role: Role, params: Any) -> None:
        """Count the wait in an engine's returned ``params`` (if any) and take its fields out:
        a holding's params go on to the next turn's prefill engine."""
        if not isinstance(params, dict):
            return
        seconds = params.pop(wire.WAITED_FOR_BLOCKS_SECONDS, None)
        beside_retained_s = params.pop(wire.WAITED_BESIDE_RETAINED_SECONDS, None)
        if not isinstance(seconds, (int, float)) or seconds < 0:
            return
        request_id = params.get(wire.REMOTE_REQUEST_ID)
        if isinstance(request_id, str):
            if (role, request_id) in self._counted:
                return
            self._counted[(role, request_id)] = None
            if len(self._counted) > _REMEMBERED:
                self._counted.popitem(last=False)
        retained = isinstance(beside_retained_s, (int, float)) and beside_retained_s > 0
        self._metrics.record_blocks_wait(role, float(seconds), beside_retained=retained)
