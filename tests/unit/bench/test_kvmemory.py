from __future__ import annotations

import httpx
import pytest

from agentkv_server.bench.kvmemory import DecodeMemoryProbe, KVUsage, parse_kv_usage

METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="agentkv-tiny"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
"""


def test_parses_usage_and_capacity() -> None:
    assert parse_kv_usage(METRICS) == KVUsage(0.25, 4000)


def test_usage_without_capacity_and_engines_without_the_metric() -> None:
    usage_only = "\n".join(METRICS.splitlines()[:3]) + "\n"
    assert parse_kv_usage(usage_only) == KVUsage(0.25, None)
    assert parse_kv_usage("# TYPE other gauge\nother 1.0\n") is None


def test_combining_engines_weights_by_capacity() -> None:
    combined = KVUsage.combine([KVUsage(0.5, 500), KVUsage(0.1, 300)])  # capacities 1000, 3000
    assert combined == KVUsage(pytest.approx(0.2), 800)
    assert KVUsage.combine([KVUsage(0.5, None), KVUsage(0.1, 10)]) == KVUsage(
        pytest.approx(0.3), None
    )
    assert KVUsage.combine([]) is None


async def test_probe_skips_engines_that_do_not_answer() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            return httpx.Response(503)
        return httpx.Response(200, text=METRICS)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        probe = DecodeMemoryProbe(["http://up/metrics", "http://down/metrics"], client)
        assert await probe.sample() == KVUsage(0.25, 4000)
        assert await DecodeMemoryProbe(["http://down/metrics"], client).sample() is None
