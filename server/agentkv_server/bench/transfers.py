"""KV transfer time as the engines report it, from their Prometheus ``/metrics``.

vLLM 0.32's NIXL connector (and so agentkv's) exports ``vllm:nixl_xfer_time_seconds``, a
histogram of the duration of each NIXL read an engine made: on a prefill engine the pull of a
held history from its decode holder, on a decode engine the read of the prefill engine's new
blocks. The router cannot see these inside its P and D steps, so the benchmark reads the
histogram's sum and count before and after each mode's sessions of one history length. They
count every read in that window, decoding sessions' included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["TRANSFER_METRIC", "TransferProbe", "TransferTotals", "parse_transfer_totals"]

TRANSFER_METRIC = "vllm:nixl_xfer_time_seconds"


@dataclass(frozen=True)
class TransferTotals:
    """NIXL reads an engine (or several) made so far, and their summed duration."""

    reads: int
    seconds: float

    def __sub__(self, earlier: TransferTotals) -> TransferTotals:
        return TransferTotals(self.reads - earlier.reads, self.seconds - earlier.seconds)

    def __add__(self, other: TransferTotals) -> TransferTotals:
        return TransferTotals(self.reads + other.reads, self.seconds + other.seconds)


def parse_transfer_totals(text: str) -> TransferTotals | None:
    """The reads in one engine's ``/metrics`` text; None when it exports no such histogram
    (an engine without a NIXL connector). A connector that has not read yet counts zero."""
    reads, seconds, seen = 0.0, 0.0, False
    for family in text_string_to_metric_families(text):
        if family.name != TRANSFER_METRIC:
            continue
        seen = True
        for sample in family.samples:
            if sample.name == f"{TRANSFER_METRIC}_count":
                reads += sample.value
            elif sample.name == f"{TRANSFER_METRIC}_sum":
                seconds += sample.value
    return TransferTotals(round(reads), seconds) if seen else None


class TransferProbe:
    """Reads the summed transfer totals of some engines; a failed scrape or an engine without
    the histogram makes the whole sample None (a partial sum would read as fewer reads)."""

    def __init__(self, metrics_urls: Sequence[str], client: httpx.AsyncClient) -> None:
        self._urls = tuple(metrics_urls)
        self._client = client

    async def sample(self) -> TransferTotals | None:
        if not self._urls:
            return None
        total = TransferTotals(0, 0.0)
        for url in self._urls:
            try:
                response = await self._client.get(url, timeout=5.0)
                response.raise_for_status()
            except httpx.HTTPError:
                return None
            totals = parse_transfer_totals(response.text)
            if totals is None:
                return None
            total += totals
        return total
