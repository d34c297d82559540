"""The decode engines' waits, preemptions and KV held, as vLLM 0.32 exports them."""

from __future__ import annotations

import asyncio

import httpx

from agentkv_server.bench.pressure_run import drain, end_sessions
from agentkv_server.bench.runner import Target
from agentkv_server.bench.waits import WaitCounters, WaitWatch, parse_engine_memory


def metrics(*, queued: int, waited: int, preempted: int, usage: float) -> str:
    """A decode engine's /metrics: ``queued`` requests scheduled, ``waited`` of them after
    more than a second."""
    quick = queued - waited
    buckets = [("0.3", quick), ("0.5", quick), ("1.0", quick), ("2.5", queued), ("+Inf", queued)]
    return "\n".join(
        [
            "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase.",
            "# TYPE vllm:request_queue_time_seconds histogram",
            *(
                f'vllm:request_queue_time_seconds_bucket{{engine="0",le="{le}"}} {float(n)}'
                for le, n in buckets
            ),
            f'vllm:request_queue_time_seconds_count{{engine="0"}} {float(queued)}',
            f'vllm:request_queue_time_seconds_sum{{engine="0"}} {3.0 * waited}',
            "# TYPE vllm:num_preemptions counter",
            f'vllm:num_preemptions_total{{engine="0"}} {float(preempted)}',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}',
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0',
            "",
        ]
    )


def test_parse_counts_requests_that_waited_over_the_threshold() -> None:
    engine = parse_engine_memory(metrics(queued=10, waited=3, preempted=2, usage=0.25))
    assert engine.counters == WaitCounters(requests=10, waited=3, preemptions=2)
    assert (engine.capacity_tokens, engine.block_size, engine.used_tokens) == (16000, 16, 4000)
    assert parse_engine_memory(
        metrics(queued=10, waited=3, preempted=0, usage=0), 2.5
    ).counters == (WaitCounters(requests=10, waited=0, preemptions=0))


def test_an_engine_that_exports_nothing_says_nothing() -> None:
    engine = parse_engine_memory('vllm:prompt_tokens_total{engine="0"} 5.0\n')
    assert engine.counters == WaitCounters() and engine.used_tokens is None


class Engine:
    """A decode engine's /metrics, changed between reads by the test."""

    def __init__(self) -> None:
        self.text = metrics(queued=4, waited=1, preempted=0, usage=0.1)
        self.reads = 0
        self.deleted: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            self.deleted.append(request.url.path)
            return httpx.Response(404)
        self.reads += 1
        return httpx.Response(200, text=self.text)


async def test_a_watch_reports_the_growth_of_counters_and_the_peak_between() -> None:
    engine = Engine()
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine.handle)) as http:
        watch = WaitWatch(["http://d/metrics"], http, interval_s=0.01)
        async with watch.running():
            engine.text = metrics(queued=9, waited=3, preempted=1, usage=0.75)
            while engine.reads < 3:
                await asyncio.sleep(0.005)
            engine.text = metrics(queued=12, waited=3, preempted=1, usage=0.2)
    assert watch.result is not None
    assert watch.result.counters == WaitCounters(requests=8, waited=2, preemptions=1)
    assert (watch.result.peak_tokens, watch.result.peak_fraction) == (12000, 0.75)
    assert watch.result.capacity_tokens == 16000


async def test_drain_waits_until_the_retained_kv_is_gone() -> None:
    engine = Engine()
    held = [0.6, 0.3, 0.01, 0.0]
    said: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        engine.text = metrics(queued=0, waited=0, preempted=0, usage=held[engine.reads])
        return engine.handle(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        await drain(["http://d/metrics"], http, 500.0, said.append, poll_s=0.001)
    assert engine.reads == 3  # down to 1%: the floor (2%)
    assert "60% held" in said[0]


async def test_end_sessions_asks_a_router_never_an_engine() -> None:
    engine = Engine()
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine.handle)) as http:
        await end_sessions(Target("agentkv", ("http://r",), "m"), http, ["s1", "s2"])
        await end_sessions(Target("aggregated", ("http://e",), "m", tag_body=False), http, ["s"])
    assert engine.deleted == ["/v1/sessions/s1", "/v1/sessions/s2"]
