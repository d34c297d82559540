"""What a mode's router counted over a run, from its ``GET /metrics``: turns it refused and
queued at admission, and engines it marked down (healthy to down).

Read before and after a run; the difference is the run's. A counter whose family the router
does not expose at all (a router from before admission control) reads None, never 0: the report
then says it was not measured. A family with no sample yet (nothing counted) reads 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentkv_server.wire import SECRET_HEADER

__all__ = [
    "MARKED_DOWN_METRIC",
    "QUEUED_METRIC",
    "REFUSED_METRIC",
    "RouterCounts",
    "parse_router_counts",
    "scrape_router",
]

REFUSED_METRIC: Final = "agentkv_admission_refused_total"
QUEUED_METRIC: Final = "agentkv_admission_queued_total"
MARKED_DOWN_METRIC: Final = "agentkv_engines_marked_down_total"
_SCRAPE_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True)
class RouterCounts:
    """Turns refused and queued at admission and engines marked down, every label summed."""

    refused: float | None = None
    queued: float | None = None
    marked_down: float | None = None

    def __sub__(self, earlier: RouterCounts) -> RouterCounts:
        def delta(name: str) -> float | None:
            now, then = getattr(self, name), getattr(earlier, name)
            return None if now is None or then is None else now - then

        return RouterCounts(*(delta(f.name) for f in fields(self)))


async def scrape_router(
    http: httpx.AsyncClient, router_url: str, secret: str | None = None
) -> RouterCounts | None:
    """The router's counts now; None when it does not answer. ``secret``: the router's shared
    secret, which ``/metrics`` asks for once API keys are configured."""
    headers = {SECRET_HEADER: secret} if secret else {}
    try:
        response = await http.get(
            f"{router_url.rstrip('/')}/metrics", headers=headers, timeout=_SCRAPE_TIMEOUT_S
        )
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_router_counts(response.text)


def parse_router_counts(text: str) -> RouterCounts:
    """The counts in a ``/metrics`` text (Prometheus exposition format)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for metric in (REFUSED_METRIC, QUEUED_METRIC, MARKED_DOWN_METRIC):
            if family.name in (metric, metric.removesuffix("_total")):
                totals[metric] = sum(s.value for s in family.samples if s.name == metric)
    return RouterCounts(
        totals.get(REFUSED_METRIC), totals.get(QUEUED_METRIC), totals.get(MARKED_DOWN_METRIC)
    )
