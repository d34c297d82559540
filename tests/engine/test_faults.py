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
import contextlib
import json
import logging
import os
import random
import signal
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.bundle.launcher import EngineProcess
from agentkv_server.bundle.stack import Stack
from agentkv_server.router import InMemoryStore
from agentkv_server.router.placement import Engine
from agentkv_server.settings import Settings
from agentkv_server.testing import RedisServer, serve_in_process, serve_on_loopback
from agentkv_server.testing.conditions import require
from agentkv_server.testing.probe import LOGPROB_TOLERANCE, EngineClient, KVProbe, logprob_gap

pytestmark = [pytest.mark.engine, pytest.mark.kills_engines]

BLOCK = 128  # vLLM's KV block on the CPU backend: P pulls whole blocks
OUTPUT = 16  # D holds prompt + OUTPUT - 1 tokens
HISTORY = 4 * BLOCK - OUTPUT + 1  # turn 1 holds 4 whole blocks
NEW = BLOCK - OUTPUT  # each later turn one block more
TURN_TIMEOUT_S = 180.0
PULL_TIMEOUT_S = 15.0
IN_FLIGHT_S = 2.0  # a pull from a dead holder stalls P's step until the router gives up
PULLED = "vllm:external_prefix_cache_hits_total"
HEALTH_INTERVAL_S = 2.0  # the 1P2D routers' health probes
FREEZE_S = 60.0


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
        body = self.probe.judged_body(self.prompt, OUTPUT)
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
    defaults: dict[str, Any] = {
        "health_interval_s": 3600.0,  # faults are found by the turns themselves
        "timeouts": {"pull_s": PULL_TIMEOUT_S},
        "policy": "always",  # as ALWAYS_PULL in conftest.py: the faults are in the KV path
    }
    return Settings(
        prefill_urls=tuple(prefill or [engine.url for engine in stack.prefill]),
        decode_urls=tuple(decode or [engine.url for engine in stack.decode]),
        **(defaults | options),
    )


def one_p_two_d(
    stack: Stack, second_decode: EngineProcess, prefill: list[str] | None = None, **options: Any
) -> Settings:
    """A router over 1P2D whose health probes run (they bring a suspect engine back)."""
    decode = [second_decode.url, stack.decode[0].url]
    return router_settings(stack, decode, prefill, health_interval_s=HEALTH_INTERVAL_S, **options)


def fault_cost_bound(tally: Tally) -> float:
    """What the turn after a fault may take: twice a cold turn (the session's first) plus one
    health interval."""
    return 2 * tally.seconds[0] + HEALTH_INTERVAL_S


def assert_serving(*engines: EngineProcess) -> None:
    """Engines no fault was aimed at still run and answer /health."""
    for engine in engines:
        assert engine.is_running(), f"{engine.url} exited"
        with urllib.request.urlopen(engine.url + "/health", timeout=10) as response:
            assert response.status == 200, f"{engine.url} is not healthy"


@contextlib.contextmanager
def frozen_engine(engine: EngineProcess) -> Iterator[None]:
    """The whole engine (API server, core, workers) stopped (SIGSTOP) while the block runs: it
    accepts connections and answers nothing."""
    pid = engine.pid
    assert pid is not None
    os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pid, signal.SIGCONT)


async def wait_healthy(engine: Engine | None) -> None:
    """Until the router's health probes bring a resumed engine back."""
    assert engine is not None
    deadline = time.monotonic() + 10 * HEALTH_INTERVAL_S
    while not engine.healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert engine.healthy, f"the resumed engine {engine.url}'s health probe never passed"


def serve(settings: Settings, store: InMemoryStore | None = None):
    return serve_in_process(settings, store=store, timeout_s=TURN_TIMEOUT_S)


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


async def test_router_restarted_with_redis_resumes_reuse(
    stack: Stack, probe: KVProbe, tally: Tally
) -> None:
    require(None if RedisServer.available() else "redis-server not found (scripts/install --dev)")
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


# The cases below kill or freeze engines. They run last (conftest.py) and in this order: the
# module's second decode engine is frozen, then killed.


async def test_prefill_engine_frozen_between_turns(
    stack: Stack,
    probe: KVProbe,
    doomed_prefill: EngineProcess,
    second_decode: EngineProcess,
    tally: Tally,
) -> None:
    """The only P stops (SIGSTOP) between turns: it accepts the next step's connection and
    answers nothing. Health probes sent as that step starts find it within about a second; the
    turn and the next are served decode-only; once resumed, P is back in use (a pull)."""
    conversation = Conversation(probe, tally, seed=550)
    settings = one_p_two_d(stack, second_decode, [doomed_prefill.url])
    async with serve(settings) as (app, client):
        await conversation.turn(client)
        with frozen_engine(doomed_prefill):
            for _ in range(2):
                await conversation.turn(client)
        await wait_healthy(app.state.router.prefill.get(doomed_prefill.url))
        await conversation.turn(client)
        metrics = (await client.get("/metrics")).text

    assert tally.all_good(4)
    # P is back: it pulled the history decode-only turns left on D (``reuse``: P's usage
    # counted the pulled tokens as cached; a pull that failed would read ``fallback``).
    assert tally.paths == ["recompute", "fallback", "fallback", "reuse"]
    assert 'agentkv_engine_errors_total{kind="hang",role="prefill"}' in metrics
    assert max(tally.seconds[1:3]) <= fault_cost_bound(tally)
    assert_serving(stack.prefill[0], stack.decode[0], second_decode, doomed_prefill)


async def test_prefill_engine_killed_mid_request(
    stack: Stack,
    probe: KVProbe,
    doomed_prefill: EngineProcess,
    second_decode: EngineProcess,
    tally: Tally,
) -> None:
    """P dies holding a turn's request. P is stopped (SIGSTOP) before the turn is sent and
    killed while the router waits on it, so the kill lands mid-request however fast the
    machine is (the health probes sent with the step are given longer than that, or they would
    find the stopped P first: test_prefill_engine_frozen_between_turns). The router serves that
    turn decode-only, and the next one too (P is gone)."""
    conversation = Conversation(probe, tally, seed=500)
    settings = one_p_two_d(
        stack, second_decode, [doomed_prefill.url], faults={"liveness_timeout_s": 10 * IN_FLIGHT_S}
    )
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
    # The kill drops the connection P had accepted: a disconnect (P suspect; the health probes
    # that P then refuses mark it lost).
    assert 'agentkv_engine_errors_total{kind="disconnect",role="prefill"}' in metrics
    assert tally.seconds[2] <= fault_cost_bound(tally)
    assert_serving(stack.prefill[0], stack.decode[0], second_decode)


def test_prefill_engine_killed_before_decode_reads_its_answer(
    stack: Stack, probe: KVProbe, killable_prefill: EngineProcess, tally: Tally
) -> None:
    """P dies after answering a follow-up's step, before D reads the new blocks. The turn before
    proved the pair, so D's read is synchronous (docs/connector.md, "Synchronous loads"): it
    fails in the step, D computes those tokens itself, and the answer is the recompute's."""
    dying = KVProbe(EngineClient(killable_prefill.url, stack.served_name), probe.d)
    prompt = tokens(600, HISTORY)
    started = time.monotonic()
    _, first = dying.turn(prompt, max_tokens=OUTPUT, retention_seconds=120)
    tally.seconds.append(time.monotonic() - started)
    assert first.holding[wire.KV_LOAD] == wire.KV_LOAD_OK
    prompt = prompt + first.token_ids + tokens(601, NEW)
    prefill = dying.prefill(prompt, first.holding)
    killable_prefill.kill()

    answer = dying.decode_first_token(prompt, prefill)
    tally.seconds.append(answer.seconds)
    tally.sent = tally.succeeded = 1

    assert (answer.params[wire.KV_LOAD], answer.params.get(wire.KV_LOAD_SYNC)) == (
        wire.KV_LOAD_FAILED,
        True,
    )
    assert logprob_gap(answer.top_logprobs, probe.recomputed_logprobs(prompt)) < LOGPROB_TOLERANCE
    tally.correct = 1
    assert tally.seconds[1] <= fault_cost_bound(tally)
    assert_serving(stack.prefill[0], stack.decode[0])


async def test_decode_holder_frozen_for_a_minute(
    stack: Stack, probe: KVProbe, second_decode: EngineProcess, tally: Tally
) -> None:
    """The holder stops (SIGSTOP) for a minute: it accepts connections and answers nothing.
    The turn after recomputes (the holder fails its liveness probe) and decodes on the other
    engine; once resumed, the holder's health probe brings it back into use."""
    frozen = second_decode
    store = InMemoryStore(max_sessions=100, ticket_ttl_s=900.0)
    conversation = Conversation(probe, tally, seed=600)
    async with serve(router_settings(stack, decode=[frozen.url]), store) as (_, client):
        await conversation.turn(client)  # the session's KV is held on the engine to freeze
    async with serve(one_p_two_d(stack, frozen), store) as (app, client):
        with frozen_engine(frozen):
            froze = time.monotonic()
            for _ in range(2):  # a recompute, then a reuse from the other engine
                await conversation.turn(client)
            await asyncio.sleep(max(0.0, FREEZE_S - (time.monotonic() - froze)))
        await wait_healthy(app.state.router.decode.get(frozen.url))
        await conversation.turn(client)
        metrics = (await client.get("/metrics")).text

    assert tally.all_good(4)
    assert tally.paths == ["recompute", "fallback", "reuse", "reuse"]
    assert 'agentkv_engine_errors_total{kind="timeout",role="decode"}' in metrics
    assert tally.seconds[1] <= fault_cost_bound(tally)
    assert_serving(stack.prefill[0], stack.decode[0], frozen)


async def test_decode_non_holder_frozen(
    stack: Stack, probe: KVProbe, second_decode: EngineProcess
) -> None:
    """The decode engine that holds nothing for a session stops (SIGSTOP). The turns still
    answer within the bound: a step sent to it is left when the health probes sent with it go
    unanswered, and the turn decodes on the other engine."""
    frozen, survivor = second_decode, stack.decode[0]
    held_tally, fresh_tally = Tally("decode_non_holder_frozen"), Tally("new_session_beside_it")
    TALLIES.extend([held_tally, fresh_tally])
    held = Conversation(probe, held_tally, seed=800)
    fresh = Conversation(probe, fresh_tally, seed=900)
    store = InMemoryStore(max_sessions=100, ticket_ttl_s=900.0)
    async with serve(router_settings(stack, decode=[survivor.url]), store) as (_, client):
        await held.turn(client)  # its KV is held on the survivor
    async with serve(one_p_two_d(stack, frozen), store) as (app, client):
        with frozen_engine(frozen):
            for _ in range(2):  # ties between the decode engines rotate: each is picked
                await fresh.turn(client)
                await held.turn(client)
        await wait_healthy(app.state.router.decode.get(frozen.url))
        metrics = (await client.get("/metrics")).text

    assert held_tally.all_good(3) and fresh_tally.all_good(2)
    assert held_tally.paths == ["recompute", "reuse", "reuse"]
    assert 'agentkv_engine_errors_total{kind="hang",role="decode"}' in metrics
    assert max(held_tally.seconds[1:]) <= fault_cost_bound(held_tally)
    # The new session has no cold turn before the fault: its first turn is bounded by the
    # other session's.
    assert max(fresh_tally.seconds) <= fault_cost_bound(held_tally)
    assert_serving(stack.prefill[0], survivor, frozen)


async def test_decode_engine_killed_between_turns(
    stack: Stack, probe: KVProbe, second_decode: EngineProcess
) -> None:
    """One kill, two sessions: for one the killed engine held its KV, for the other it was the
    non-holder. Neither waits on the dead engine: its holder is found dead before a pull is
    planned, and the other session goes on pulling from the surviving engine.

    Right after the kill, P is also asked to pull the dead holder's KV directly, as a router
    that planned the turn a moment before the kill would: P's connector fails the pull and P
    computes the prefix itself, in about a cold step (before, the request stayed parked on P).
    """
    doomed, survivor = second_decode, stack.decode[0]
    holder_tally, bystander_tally = Tally("decode_holder_killed"), Tally("decode_non_holder_killed")
    dead_pull_tally = Tally("pull_planned_from_killed_holder")
    TALLIES.extend([holder_tally, bystander_tally, dead_pull_tally])
    held = Conversation(probe, holder_tally, seed=100)
    bystander = Conversation(probe, bystander_tally, seed=700)
    store = InMemoryStore(max_sessions=100, ticket_ttl_s=900.0)
    for conversation, engine in ((held, doomed), (bystander, survivor)):
        async with serve(router_settings(stack, decode=[engine.url]), store) as (_, client):
            for _ in range(2):  # the second pulls from the engine: P is connected to it
                await conversation.turn(client)
    doomed.kill()
    await pull_from_dead_holder(probe, store, held, dead_pull_tally)
    async with serve(one_p_two_d(stack, doomed), store) as (_, client):
        for _ in range(2):
            await held.turn(client)
            await bystander.turn(client)
        metrics = (await client.get("/metrics")).text

    assert dead_pull_tally.all_good(1)
    assert dead_pull_tally.pulled[0] > 0  # P planned the pull from the dead holder
    assert dead_pull_tally.seconds[0] <= fault_cost_bound(holder_tally)
    assert holder_tally.all_good(4) and bystander_tally.all_good(4)
    assert holder_tally.paths == ["recompute", "reuse", "fallback", "reuse"]
    assert bystander_tally.paths == ["recompute", "reuse", "reuse", "reuse"]
    assert all(pulled > 0 for pulled in holder_tally.pulled[3:] + bystander_tally.pulled[1:])
    assert 'kind="stall"' not in metrics  # no pull was ever planned from the dead holder
    assert holder_tally.seconds[2] <= fault_cost_bound(holder_tally)
    assert bystander_tally.seconds[2] <= fault_cost_bound(bystander_tally)
    assert_serving(stack.prefill[0], survivor)


async def pull_from_dead_holder(
    probe: KVProbe, store: InMemoryStore, conversation: Conversation, tally: Tally
) -> None:
    """P's step for the conversation's next turn, pulling its holding (left in the store)."""
    holding = await store.take(conversation.session)
    assert holding is not None
    await store.offer(holding)
    tally.sent += 1
    step = await asyncio.to_thread(probe.prefill, conversation.prompt, holding.params)
    tally.succeeded += 1
    tally.seconds.append(step.seconds)
    tally.paths.append("P pulls from the dead holder")
    tally.pulled.append(step.pulled_tokens)
    wanted = await asyncio.to_thread(probe.recomputed_logprobs, conversation.prompt)
    if logprob_gap(step.top_logprobs, wanted) < LOGPROB_TOLERANCE:
        tally.correct += 1


STREAMED = 160  # greedy tokens: the stream is frozen after its first, far from its last
GENERATED = "vllm:generation_tokens_total"
SETTLE_S = 0.5  # the frozen engine's API server still counts outputs already on their way
# A frozen stream is left after 2 s of silence and two unanswered 0.5 s health probes; the
# bound leaves room for a loaded machine and is far below stall_s (60 s), the wait before.
FROZEN_STREAM_BOUND_S = 15.0


@dataclass
class KilledStream:
    """A stream whose decode engine was SIGKILLed mid-answer: the router's response, its
    chunks (``[DONE]`` checked and removed) and the router's metrics afterwards."""

    response: httpx.Response
    chunks: list[dict[str, Any]]
    metrics: str
    after_fault_s: float  # from the kill (or freeze) to the stream's end


def engine_core(engine: EngineProcess) -> list[psutil.Process]:
    """The engine's core and worker processes: all but its API server."""
    assert engine.pid is not None
    return psutil.Process(engine.pid).children(recursive=True)


def carries_a_token(event: str) -> bool:
    """An SSE event of a completions or chat stream with generated text or token ids in it."""
    if event == "[DONE]":
        return False
    return any(
        c.get("text") or (c.get("delta") or {}).get("content") or c.get("token_ids")
        for c in json.loads(event).get("choices") or ()
    )


async def settled_metric(client: EngineClient, name: str) -> float:
    """The counter once two reads ``SETTLE_S`` apart agree."""
    value = await asyncio.to_thread(client.metric, name)
    while True:
        await asyncio.sleep(SETTLE_S)
        again = await asyncio.to_thread(client.metric, name)
        if again == value:
            return value
        value = again


async def read_stream(
    url: str, route: str, body: dict[str, Any], on_first_token: Callable[[], None]
) -> tuple[httpx.Response, list[str]]:
    """POST ``body`` to ``url`` and read its SSE events, calling ``on_first_token`` as the first
    generated token arrives: in this coroutine, with no poll in between for a fast engine to
    finish its answer in (one did, between two polls of its token counter)."""
    events: list[str] = []
    token_seen = False
    async with (
        httpx.AsyncClient(base_url=url, timeout=TURN_TIMEOUT_S) as client,
        client.stream("POST", route, json=body) as response,
    ):
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if not token_seen and carries_a_token(events[-1]):
                token_seen = True
                on_first_token()
    return response, events


async def stream_with_its_decode_engine_killed(
    stack: Stack,
    tally: Tally,
    doomed_decode: EngineProcess,
    route: str,
    body: dict[str, Any],
    *,
    frozen: bool = False,
) -> KilledStream:
    """Send ``body`` streamed to ``route`` through a 1P2D router in front of ``doomed_decode``
    and another decode engine; SIGKILL ``doomed_decode`` mid-answer (``frozen``: SIGSTOP the
    whole engine, API server included, until the stream is read) and read the whole stream.

    The router is served on loopback so that the client sees the first token as it comes, and
    the doomed engine's core is frozen right then; the engine makes a token per DOOMED_STEP_S
    or slower, so its stream is far from its end. Nothing but this stream runs on
    ``doomed_decode`` (its own engine, this router's only traffic), so its generated-token
    counter, read once settled, proves where the stream ran, and fewer tokens than the
    answer's ``max_tokens`` prove that the fault lands mid-stream.
    """
    settings = router_settings(stack, decode=[doomed_decode.url, stack.decode[0].url])
    doomed = EngineClient(doomed_decode.url, body["model"])
    first_token = asyncio.Event()
    core = engine_core(doomed_decode)

    def freeze_core() -> None:
        for process in core:
            process.send_signal(signal.SIGSTOP)
        first_token.set()

    async with serve(settings) as (app, client), serve_on_loopback(app) as url:
        generated_before = await asyncio.to_thread(doomed.metric, GENERATED)
        tally.sent += 1
        began = time.monotonic()
        streamed = asyncio.create_task(read_stream(url, route, body, freeze_core))
        waiting = asyncio.create_task(first_token.wait())
        await asyncio.wait({streamed, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert first_token.is_set(), f"the stream ended with no token: {streamed.result()}"
        first_token_s = time.monotonic() - began
        generated = await settled_metric(doomed, GENERATED) - generated_before
        assert 0 < generated < body["max_tokens"], (
            f"{generated} tokens on it when frozen, {first_token_s:.2f} s after the request; "
            f"its core: {[(p.pid, p.name(), p.status()) for p in core]}"
        )
        faulted = time.monotonic()
        if frozen:
            assert doomed_decode.pid is not None
            os.killpg(doomed_decode.pid, signal.SIGSTOP)
        else:
            doomed_decode.kill()
        response, events = await streamed
        after_fault_s = time.monotonic() - faulted
        tally.seconds.append(time.monotonic() - began)
        doomed_decode.kill()  # a frozen one too: it is the test's own
        tally.paths.append(response.headers.get(protocol.HEADER_KV_PATH))
        metrics = (await client.get("/metrics")).text

    assert response.status_code == 200
    tally.succeeded += 1
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    return KilledStream(response, chunks, metrics, after_fault_s)


def greedy_stream_body(probe: KVProbe, prompt: list[int]) -> dict[str, Any]:
    """A streamed greedy completion of ``prompt``, ``STREAMED`` tokens long, with token ids."""
    return {
        "model": probe.p.model,
        "prompt": prompt,
        "max_tokens": STREAMED,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
        "stream": True,
    }


def assert_uninterrupted(
    stream: KilledStream, survivor: EngineProcess, probe: KVProbe, prompt: list[int]
) -> None:
    """The client's tokens are those of one greedy run of ``prompt`` on ``survivor``."""
    got = [t for chunk in stream.chunks for c in chunk["choices"] for t in c["token_ids"] or ()]
    uninterrupted = EngineClient(survivor.url, probe.p.model).complete(
        prompt, max_tokens=STREAMED, ignore_eos=True, temperature=0, return_token_ids=True
    )
    assert got == uninterrupted["choices"][0]["token_ids"]


async def test_decode_engine_killed_mid_stream_is_continued_on_the_other(
    stack: Stack, probe: KVProbe, doomed_decode: EngineProcess, tally: Tally
) -> None:
    """SIGKILL the decode engine while it streams a greedy answer: the router continues the
    same stream on the other decode engine (prompt + tokens sent, recomputed there), and the
    client's tokens are those of an uninterrupted greedy run, each once, ending in [DONE]."""
    survivor = stack.decode[0]
    prompt = tokens(900, HISTORY)
    body = greedy_stream_body(probe, prompt)
    killed = await stream_with_its_decode_engine_killed(
        stack, tally, doomed_decode, "/v1/completions", body
    )

    assert_uninterrupted(killed, survivor, probe, prompt)
    tally.correct += 1
    assert "agentkv_streams_resumed_total 1.0" in killed.metrics
    assert_serving(stack.prefill[0], survivor)


async def test_decode_engine_frozen_mid_stream_is_continued_within_seconds(
    stack: Stack, probe: KVProbe, doomed_decode: EngineProcess, tally: Tally
) -> None:
    """SIGSTOP the whole decode engine while it streams: the stream falls silent, its health
    probes go unanswered, and the router continues it on the other engine within seconds, not
    after ``stall_s`` (60 s) of silence; the client's tokens are an uninterrupted greedy run."""
    prompt = tokens(950, HISTORY)
    body = greedy_stream_body(probe, prompt)
    frozen = await stream_with_its_decode_engine_killed(
        stack, tally, doomed_decode, "/v1/completions", body, frozen=True
    )

    assert_uninterrupted(frozen, stack.decode[0], probe, prompt)
    tally.correct += 1
    assert "agentkv_streams_resumed_total 1.0" in frozen.metrics
    print(
        f"\nthe frozen engine's stream went on elsewhere {frozen.after_fault_s:.1f} s after the freeze"
    )
    assert frozen.after_fault_s < FROZEN_STREAM_BOUND_S
    assert_serving(stack.prefill[0], stack.decode[0])


async def test_chat_stream_of_a_killed_decode_engine_is_continued(
    stack: Stack, probe: KVProbe, doomed_decode: EngineProcess, tally: Tally
) -> None:
    """The chat continuation (partial assistant message, ``continue_final_message``) is one
    vLLM accepts, and the client's stream is one answer ending in a single [DONE]."""
    body: dict[str, Any] = {
        "model": probe.p.model,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(300))}],
        "max_tokens": STREAMED,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    killed = await stream_with_its_decode_engine_killed(
        stack, tally, doomed_decode, "/v1/chat/completions", body
    )

    chunks = killed.chunks
    assert len({chunk["id"] for chunk in chunks}) == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == STREAMED  # counted over the whole answer
    text = "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"])
    assert text
    tally.correct += 1
    assert "agentkv_streams_resumed_total 1.0" in killed.metrics
    assert_serving(stack.prefill[0], stack.decode[0])
