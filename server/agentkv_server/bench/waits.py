"""What the decode engines say about memory over a run: requests that waited in their queue,
preemptions, and the most KV they held, from their Prometheus ``/metrics``.

vLLM 0.32 times each request's wait before it is first scheduled (``WAITING``: no free blocks,
or no room in the batch) in the ``vllm:request_queue_time_seconds`` histogram and counts
running requests pushed out for memory in ``vllm:num_preemptions``. A decode engine schedules a
turn at once while blocks are free, so a wait past ``WAIT_THRESHOLD_S`` is a turn (or a
release) that waited for blocks. Counters are read before and after a run; the KV held is
sampled every ``interval_s`` in between, since a peak between two turns would escape the
per-turn samples.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentkv_server.bench.kvmemory import CACHE_INFO_METRIC, USAGE_METRIC
from agentkv_server.router import blockwaits

__all__ = [
    "QUEUE_METRIC",
    "WAIT_THRESHOLD_S",
    "EngineMemory",
    "HoldingWaits",
    "WaitCounters",
    "WaitWatch",
    "WatchResult",
    "parse_engine_memory",
    "waits_beside_holdings",
]

QUEUE_METRIC = "vllm:request_queue_time_seconds"
PREEMPTIONS_METRIC = "vllm:num_preemptions"
# One of vLLM's queue-time bucket bounds: a wait this long is no scheduling step's.
WAIT_THRESHOLD_S = 1.0


@dataclass(frozen=True)
class WaitCounters:
    """Requests out of the queue so far, those that waited over the threshold, preemptions."""

    requests: float = 0.0
    waited: float = 0.0
    preemptions: float = 0.0

    def __add__(self, other: WaitCounters) -> WaitCounters:
        return WaitCounters(
            self.requests + other.requests,
            self.waited + other.waited,
            self.preemptions + other.preemptions,
        )

    def __sub__(self, earlier: WaitCounters) -> WaitCounters:
        return WaitCounters(
            self.requests - earlier.requests,
            self.waited - earlier.waited,
            self.preemptions - earlier.preemptions,
        )


@dataclass(frozen=True)
class EngineMemory:
    """One scrape of one engine: its counters, KV in use and its KV cache's size."""

    counters: WaitCounters
    used_fraction: float | None
    capacity_tokens: int | None
    block_size: int | None

    @property
    def used_tokens(self) -> int | None:
        if self.used_fraction is None or self.capacity_tokens is None:
            return None
        return round(self.used_fraction * self.capacity_tokens)


def parse_engine_memory(text: str, threshold_s: float = WAIT_THRESHOLD_S) -> EngineMemory:
    """The figures above in one engine's ``/metrics`` text (absent ones: zero or None)."""
    count = within = preemptions = 0.0
    usage: list[float] = []
    capacity = block_size = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{QUEUE_METRIC}_count":
                count += sample.value
            elif sample.name == f"{QUEUE_METRIC}_bucket" and _le(sample.labels) == threshold_s:
                within += sample.value
            elif sample.name == f"{PREEMPTIONS_METRIC}_total":
                preemptions += sample.value
            elif sample.name == USAGE_METRIC:
                usage.append(sample.value)
            elif sample.name == CACHE_INFO_METRIC:
                capacity, block_size = _cache_size(sample.labels)
    return EngineMemory(
        WaitCounters(count, count - within, preemptions),
        sum(usage) / len(usage) if usage else None,
        capacity,
        block_size,
    )


def _le(labels: dict[str, str]) -> float | None:
    try:
        return float(labels["le"])
    except (KeyError, ValueError):
        return None


def _cache_size(labels: dict[str, str]) -> tuple[int | None, int | None]:
    try:
        blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        return None, None
    return blocks * block_size, block_size


@dataclass(frozen=True)
class WatchResult:
    """The decode engines over one run: counters' growth, peak KV held, KV cache size."""

    counters: WaitCounters | None
    peak_tokens: int | None
    peak_fraction: float | None
    capacity_tokens: int | None
    block_size: int | None


class WaitWatch:
    """Watches the decode engines while a run goes on (``async with watch.running(): ...``);
    a failed scrape is a missing sample, never an error."""

    def __init__(
        self, metrics_urls: Sequence[str], client: httpx.AsyncClient, interval_s: float = 1.0
    ) -> None:
        self._urls = tuple(metrics_urls)
        self._client = client
        self._interval_s = interval_s
        self._peaks: list[tuple[int | None, float | None]] = []
        self.result: WatchResult | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[WaitWatch]:
        before = await self.scrape()
        task = asyncio.create_task(self._poll())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            after = await self.scrape()
            self.result = self._result(before, after)

    async def scrape(self) -> list[EngineMemory]:
        found = []
        for url in self._urls:
            try:
                response = await self._client.get(url, timeout=5.0)
                response.raise_for_status()
            except httpx.HTTPError:
                continue
            found.append(parse_engine_memory(response.text))
        self._note(found)
        return found

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.scrape()

    def _note(self, engines: list[EngineMemory]) -> None:
        tokens = [t for e in engines if (t := e.used_tokens) is not None]
        fractions = [f for e in engines if (f := e.used_fraction) is not None]
        self._peaks.append((sum(tokens) if tokens else None, max(fractions, default=None)))

    def _result(self, before: list[EngineMemory], after: list[EngineMemory]) -> WatchResult:
        counters = None
        if before and len(before) == len(after):
            counters = _total(after) - _total(before)
        tokens = [t for t, _ in self._peaks if t is not None]
        fractions = [f for _, f in self._peaks if f is not None]
        sized = [e for e in after if e.capacity_tokens is not None]
        return WatchResult(
            counters,
            max(tokens) if tokens else None,
            max(fractions) if fractions else None,
            sum(e.capacity_tokens or 0 for e in sized) if sized else None,
            sized[0].block_size if sized else None,
        )


def _total(engines: list[EngineMemory]) -> WaitCounters:
    total = WaitCounters()
    for engine in engines:
        total = total + engine.counters
    return total


@dataclass(frozen=True)
class HoldingWaits:
    """Decode requests kept waiting for blocks by unreleased holdings, and their seconds of
    waiting in all (each request's whole wait)."""

    requests: int
    seconds: float

    def __sub__(self, earlier: HoldingWaits) -> HoldingWaits:
        return HoldingWaits(self.requests - earlier.requests, self.seconds - earlier.seconds)


async def waits_beside_holdings(client: httpx.AsyncClient, router_url: str) -> HoldingWaits | None:
    """What the router behind ``router_url`` counted so far as kept waiting for blocks by
    unreleased holdings, as their engines reported it (router/blockwaits.py); None when the
    router does not answer."""
    try:
        response = await client.get(f"{router_url.rstrip('/')}/metrics", timeout=5.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    wanted = {"role": "decode", "beside": "retained"}
    found = {"_count": 0.0, "_sum": 0.0}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            suffix = sample.name.removeprefix(blockwaits.METRIC)
            if suffix in found and wanted.items() <= sample.labels.items():
                found[suffix] += sample.value
    return HoldingWaits(round(found["_count"]), found["_sum"])
