"""Reads how much KV cache the decode engines hold, from their Prometheus ``/metrics``.

vLLM 0.32 exports ``vllm:kv_cache_usage_perc`` (a 0..1 fraction per engine) and, as an info
gauge, ``vllm:cache_config_info`` whose labels include ``num_gpu_blocks`` and ``block_size``
(the KV cache's capacity, also on the CPU backend). Held tokens are usage x blocks x block size.
Retained KV of finished turns counts as used, which is what the benchmark wants to see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["DecodeMemoryProbe", "KVUsage", "parse_kv_usage"]

USAGE_METRIC = "vllm:kv_cache_usage_perc"
CACHE_INFO_METRIC = "vllm:cache_config_info"


@dataclass(frozen=True)
class KVUsage:
    """KV cache in use on one or more engines: a fraction, and tokens when capacity is known."""

    fraction: float
    tokens: int | None

    @staticmethod
    def combine(parts: Sequence[KVUsage]) -> KVUsage | None:
        """The usage of several engines taken together (their capacities weighted)."""
        if not parts:
            return None
        if all(p.tokens is not None for p in parts):
            tokens = sum(p.tokens or 0 for p in parts)
            capacity = sum((p.tokens or 0) / p.fraction for p in parts if p.fraction > 0)
            return KVUsage(tokens / capacity if capacity else 0.0, tokens)
        return KVUsage(sum(p.fraction for p in parts) / len(parts), None)


def parse_kv_usage(text: str) -> KVUsage | None:
    """The KV usage in one engine's ``/metrics`` text; None when the engine does not export it."""
    usage: list[float] = []
    capacity = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == USAGE_METRIC:
                usage.append(sample.value)
            elif sample.name == CACHE_INFO_METRIC:
                capacity += _capacity_tokens(sample.labels)
    if not usage:
        return None
    fraction = sum(usage) / len(usage)
    return KVUsage(fraction, round(fraction * capacity) if capacity else None)


def _capacity_tokens(labels: dict[str, str]) -> int:
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return 0


class DecodeMemoryProbe:
    """Samples the decode engines' KV usage; a failed scrape is a missing sample, not an error
    (the benchmark measures latency first, memory where the engines tell it)."""

    def __init__(self, metrics_urls: Sequence[str], client: httpx.AsyncClient) -> None:
        self._urls = tuple(metrics_urls)
        self._client = client

    async def sample(self) -> KVUsage | None:
        parts = [usage for url in self._urls if (usage := await self._scrape(url)) is not None]
        return KVUsage.combine(parts)

    async def _scrape(self, url: str) -> KVUsage | None:
        try:
            response = await self._client.get(url, timeout=5.0)
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        return parse_kv_usage(response.text)
