"""Faults on real engines: every turn is still answered, and answered correctly.

Routers of our own run in process in front of the shared stack's engines (and an extra decode
or prefill engine that is killed), so each case controls its router's store and lifetime without
touching the stack's own router. A turn is *correct* when its first token's top-5 logprobs
equal a full recompute of the same prompt within LOGPROB_TOLERANCE (the fp32 oracle of
docs/engines.md): reused KV that was wrong would move them by ~1.

Each case counts turns sent, succeeded (200) and correct; ``pytest -s`` prints the tally.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from agentkv import protocol
from agentkv_server.bundle.launcher import EngineProcess
from agentkv_server.bundle.probe import LOGPROB_TOLERANCE, KVProbe, logprob_gap
from agentkv_server.bundle.stack import Stack
from agentkv_server.router import InMemoryStore
from agentkv_server.settings import Settings
from agentkv_server.testing import RedisServer, serve_in_process

pytestmark = [pytest.mark.engine, pytest.mark.kills_engines]

BLOCK = 128  # vLLM's KV block on the CPU backend: P pulls whole blocks
OUTPUT = 16  # D holds prompt + OUTPUT - 1 tokens
HISTORY = 4 * BLOCK - OUTPUT + 1  # turn 1 holds 4 whole blocks
NEW = BLOCK - OUTPUT  # each later turn one block more
TURN_TIMEOUT_S = 180.0
PULL_TIMEOUT_S = 15.0
IN_FLIGHT_S = 2.0  # a pull from a dead holder stalls P's step until the router gives up
PULLED = "vllm:external_prefix_cache_hits_total"


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


@dataclass
class Tally:
    case: str
    sent: int = 0
    succeeded: int = 0
    correct: int = 0
    paths: list[str | None] = field(default_factory=list)
    # P's external prefix-cache hits per turn: counted when P schedules a pull, so a pull
    # that then fails still counts.
    pulled: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def all_good(self, turns: int) -> bool:
        return self.sent == self.succeeded == self.correct == turns


TALLIES: list[Tally] = []


@pytest.fixture(scope="module", autouse=True)
def print_tallies() -> Iterator[None]:
    yield
    print("\n| fault | sent | ok | correct | router's kv path | P pulled tokens | seconds |")
    print("|---|---|---|---|---|---|---|")
    for t in TALLIES:
        seconds = [round(s, 1) for s in t.seconds]
        print(
            f"| {t.case} | {t.sent} | {t.succeeded} | {t.correct} | {t.paths} | {t.pulled} "
            f"| {seconds} |"
        )


@pytest.fixture
def tally(request: pytest.FixtureRequest) -> Tally:
    result = Tally(request.node.name.removeprefix("test_"))
    TALLIES.append(result)
    return result


class Conversation:
    """One session's token-id turns through whichever router ``turn`` is given."""

    def __init__(self, probe: KVProbe, tally: Tally, seed: int) -> None:
        self.probe = probe
        self.tally = tally
        self.session = f"faults-{seed}-{random.randrange(1 << 30)}"
        self.prompt = tokens(seed, HISTORY)
        self._seed = seed

    async def turn(self, client: httpx.AsyncClient) -> httpx.Response:
        body: dict[str, Any] = {
            "model": self.probe.p.model,
            "prompt": self.prompt,
            "max_tokens": OUTPUT,
            "ignore_eos": True,
            "temperature": 0,
            "logprobs": self.probe.top_k,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        pulled_before = self.probe.p.metric(PULLED)
        self.tally.sent += 1
        began = time.monotonic()
        response = await client.post(
            "/v1/completions", json=body, headers={protocol.HEADER_SESSION_ID: self.session}
        )
        self.tally.seconds.append(time.monotonic() - began)
        self.tally.paths.append(response.headers.get(protocol.HEADER_KV_PATH))
        self.tally.pulled.append(round(self.probe.p.metric(PULLED) - pulled_before))
        if response.status_code == 200:
            self.tally.succeeded += 1
            choice = response.json()["choices"][0]
            wanted = self.probe.recomputed_logprobs(self.prompt)
            if logprob_gap(choice["logprobs"]["top_logprobs"][0], wanted) < LOGPROB_TOLERANCE:
                self.tally.correct += 1
            self._seed += 1
            self.prompt = self.prompt + choice["token_ids"] + tokens(self._seed, NEW)
        return response


def router_settings(
    stack: Stack,
    decode: list[str] | None = None,
    prefill: list[str] | None = None,
    **options: Any,
) -> Settings:
    return Settings(
        prefill_urls=tuple(prefill or [engine.url for engine in stack.prefill]),
        decode_urls=tuple(decode or [engine.url for engine in stack.decode]),
        health_interval_s=3600.0,  # faults are found by the turns themselves
        timeouts={"pull_s": PULL_TIMEOUT_S},
        policy="always",  # as ALWAYS_PULL in conftest.py: the faults are in the KV path
        **options,
    )


def serve(settings: Settings, store: InMemoryStore | None = None):
    return serve_in_process(settings, store=store, timeout_s=TURN_TIMEOUT_S)


async def test_prefill_engine_killed_mid_request(
    stack: Stack, probe: KVProbe, doomed_prefill: EngineProcess, tally: Tally
) -> None:
    """P dies holding a turn's request. P is stopped (SIGSTOP) before the turn is sent and
    killed while the router waits on it, so the kill lands mid-request however fast the
    machine is. The router serves that turn decode-only, and the next one too (P is gone)."""
    conversation = Conversation(probe, tally, seed=500)
    settings = router_settings(stack, prefill=[doomed_prefill.url])
    async with serve(settings) as (_, client):
        await conversation.turn(client)
        pid = doomed_prefill.pid
        assert pid is not None
        os.killpg(pid, signal.SIGSTOP)
        in_flight = asyncio.create_task(conversation.turn(client))
        await asyncio.sleep(IN_FLIGHT_S)  # the router has sent the turn to the stopped P
        assert not in_flight.done()
        doomed_prefill.kill()
        await in_flight
        await conversation.turn(client)
        metrics = (await client.get("/metrics")).text

    assert tally.all_good(3)
    assert tally.paths[:2] == ["recompute", "fallback"]
    assert 'agentkv_engine_errors_total{kind="connect",role="prefill"}' in metrics


async def test_holding_freed_early_on_the_engine(
    stack: Stack, probe: KVProbe, tally: Tally
) -> None:
    """D frees the blocks while the router still believes in them (an engine that expired or
    restarted). Measured: P still reads them (their content is intact until D reuses the
    blocks) and answers correctly; what stops a read of blocks already reused for another
    request is the connector's business (docs/connector.md)."""
    store = InMemoryStore(max_sessions=100, ticket_ttl_s=900.0)
    conversation = Conversation(probe, tally, seed=200)
    async with serve(router_settings(stack), store) as (app, client):
        await conversation.turn(client)
        key = conversation.session
        holding = await store.take(key)
        assert holding is not None
        await store.offer(holding)  # the router still believes in it...
        assert await app.state.router.keeper.release(holding)  # ...but the engine let it go
        for _ in range(2):
            await conversation.turn(client)

    assert tally.all_good(3)


async def test_redis_unreachable_serves_on_by_recompute(
    stack: Stack, probe: KVProbe, tally: Tally, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead_redis = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    conversation = Conversation(probe, tally, seed=300)
    with caplog.at_level(logging.WARNING, logger="agentkv_server.router"):
        async with serve(router_settings(stack, redis_url=dead_redis)) as (_, client):
            for _ in range(3):
                await conversation.turn(client)
            metrics = (await client.get("/metrics")).text
            health = (await client.get("/health")).json()

    assert tally.all_good(3)
    assert tally.paths == ["recompute"] * 3
    assert "agentkv_store_up 0.0" in metrics
    assert health["status"] == "degraded" and health["store_available"] is False
    assert any("serving without it" in message for message in caplog.messages)


@pytest.mark.skipif(
    not RedisServer.available() and not os.environ.get("CI"),
    reason="redis-server binary not found: scripts/install --dev installs it (CI fails instead)",
)
async def test_router_restarted_with_redis_resumes_reuse(
    stack: Stack, probe: KVProbe, tally: Tally
) -> None:
    conversation = Conversation(probe, tally, seed=400)
    with RedisServer() as redis:
        settings = router_settings(stack, redis_url=redis.url)
        async with serve(settings) as (_, client):
            for _ in range(2):
                await conversation.turn(client)
        async with serve(settings) as (_, restarted):
            for _ in range(2):
                await conversation.turn(restarted)

    assert tally.all_good(4)
    assert tally.paths[2:] == ["reuse", "reuse"]
    assert all(pulled > 0 for pulled in tally.pulled[1:])


# Last: the pull from the dead holder leaves a request parked on the stack's prefill engine for
# good (upstream defers the transfer's failure), and that engine's loop then never idles.
async def test_decode_holder_killed_between_turns(
    stack: Stack, probe: KVProbe, doomed_decode: EngineProcess, tally: Tally
) -> None:
    doomed = doomed_decode
    store = InMemoryStore(max_sessions=100, ticket_ttl_s=900.0)
    conversation = Conversation(probe, tally, seed=100)
    async with serve(router_settings(stack, decode=[doomed.url]), store) as (_, client):
        for _ in range(2):  # the second pulls from the doomed engine: P is connected to it
            await conversation.turn(client)
    doomed.kill()
    survivors = router_settings(stack, decode=[doomed.url, stack.decode[0].url])
    async with serve(survivors, store) as (_, client):
        # The pull from the dead holder stalls P's step (NIXL_ERR_REMOTE_DISCONNECT, then the
        # request waits): after pull_s the router recomputes on the same P engine, and D
        # moves to the survivor. The next turn pulls from the survivor.
        for _ in range(2):
            await conversation.turn(client)
        metrics = (await client.get("/metrics")).text

    assert tally.all_good(4)
    assert tally.paths == ["recompute", "reuse", "fallback", "reuse"]
    assert tally.pulled[1] > 0 and tally.pulled[3] > 0
    assert 'agentkv_engine_errors_total{kind="stall",role="prefill"} 1.0' in metrics
