from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from agentkv_server.bench.records import TurnRecord
from agentkv_server.testing import StubCluster, StubEngine, count_prompt_tokens

# Prefill seconds per computed token of the stub prefill engine: recomputing a few hundred
# tokens then costs more than the router's prior for a pull (50 ms), as on real engines.
PREFILL_S_PER_TOKEN = 250e-6


class ComputingPrefill(StubEngine):
    """A stub prefill engine whose steps take time in proportion to the tokens they compute,
    so that the router's cost model sees what pulling saves."""

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        pulled_before = sum(tokens for *_, tokens in self.pulled)
        response = await super()._completion(request)
        body = self.requests[-1].body
        pulled = sum(tokens for *_, tokens in self.pulled) - pulled_before
        computed = max(count_prompt_tokens(body) - pulled, 0)
        await asyncio.sleep(computed * PREFILL_S_PER_TOKEN)
        return response


async def _start_pair(cluster: StubCluster) -> tuple[StubEngine, StubEngine]:
    prefill = ComputingPrefill(cluster, "prefill")
    await prefill.start()
    cluster.engines.append(prefill)
    return prefill, await cluster.start("decode")


@pytest.fixture
def start_engines() -> Callable[[StubCluster], Awaitable[tuple[StubEngine, StubEngine]]]:
    """Starts a prefill (computing) and a decode stub engine in a cluster."""
    return _start_pair


def _turn(
    mode: str,
    turn: int,
    ttft: float,
    *,
    repeat: int = 0,
    history: int = 1000,
    session: int = 0,
    latency: float | None = None,
    prompt: int | None = 1000,
    reused: int | None = 0,
    kv: float | None = None,
    error: str | None = None,
) -> TurnRecord:
    """A synthetic record; ``latency`` defaults to ten times the TTFT."""
    return TurnRecord(
        mode=mode,
        repeat=repeat,
        history_tokens=history,
        session=session,
        turn=turn,
        tool_latency_s=0.0,
        ttft_s=None if error else ttft,
        latency_s=None if error else (latency if latency is not None else 10 * ttft),
        prompt_tokens=prompt,
        output_tokens=8,
        reused_tokens=reused,
        decode_kv_usage=kv,
        error=error,
    )


@pytest.fixture
def make_turn() -> Callable[..., TurnRecord]:
    """Builds synthetic records: ``make_turn(mode, turn, ttft, repeat=..., history=...)``."""
    return _turn


@pytest.fixture
def records() -> list[TurnRecord]:
    """Two repeats, two histories; agentkv is 4x faster on follow-ups, recompute the baseline."""
    out: list[TurnRecord] = []
    for repeat, scale in ((0, 1.0), (1, 1.5)):
        for history in (1000, 4000):
            size = history / 1000
            for t in (1, 2, 3):
                out.append(_turn("recompute", t, scale * size, repeat=repeat, history=history))
                fast = scale * size if t == 1 else scale * size / 4
                out.append(
                    _turn(
                        "agentkv",
                        t,
                        fast,
                        repeat=repeat,
                        history=history,
                        reused=0 if t == 1 else 900,
                        kv=0.1 * t,
                    )
                )
    out.append(_turn("agentkv", 4, 0.0, error="boom"))
    return out
