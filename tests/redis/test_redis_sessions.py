"""Sessions shared through a real Redis: replicas reuse each other's holdings, atomically."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from redis.asyncio import Redis

from agentkv_server.router import Holding, RedisStore, Ticket
from agentkv_server.testing import StubCluster, conversation, in_process_router

pytestmark = pytest.mark.redis


@pytest.fixture
async def store(redis_url: str):
    store = RedisStore(Redis.from_url(redis_url), prefix="t:", max_sessions=2, ticket_ttl_s=30)
    yield store
    await store.close()


def holding(
    session: str = "s", *, issued_at: float = 1.0, ttl_s: float = 60.0, request_id: str = "r"
) -> Holding:
    return Holding(
        session,
        "http://d",
        "m",
        {"remote_request_id": request_id},
        100,
        time.time() + ttl_s,
        issued_at,
    )


async def test_one_of_many_concurrent_takers_gets_the_holding(store: RedisStore):
    offered = holding()
    await store.offer(offered)
    taken = await asyncio.gather(*(store.take("s") for _ in range(20)))
    assert [h for h in taken if h is not None] == [offered]


async def test_newest_turn_wins_and_the_loser_is_returned(store: RedisStore):
    old, new = holding(issued_at=1.0, request_id="old"), holding(issued_at=2.0, request_id="new")
    assert await store.offer(old) == []
    assert await store.offer(new) == [old]
    assert await store.offer(old) == [old]
    assert await store.take("s") == new


async def test_index_is_bounded(store: RedisStore):
    soon = holding("a", ttl_s=10)
    await store.offer(soon)
    await store.offer(holding("b", ttl_s=50))
    assert await store.offer(holding("c", ttl_s=60)) == [soon]
    assert await store.count() == 2
    assert await store.take("a") is None


async def test_ended_session_refuses_turns_issued_before_the_end(store: RedisStore):
    await store.offer(holding(issued_at=1.0))
    assert await store.end("s", at=5.0) is not None
    late = holding(issued_at=4.0)
    assert await store.offer(late) == [late]
    assert await store.offer(holding(issued_at=6.0)) == []


async def test_holdings_expire(store: RedisStore):
    await store.offer(holding(ttl_s=0.2))
    await asyncio.sleep(0.3)
    assert await store.take("s") is None
    assert await store.count() == 0


async def test_tickets_pop_once(store: RedisStore):
    ticket = Ticket("t1", "s", "http://d", "m", time.time(), 60.0)
    await store.add_ticket(ticket)
    assert await asyncio.gather(store.pop_ticket("t1"), store.pop_ticket("t1")) in (
        [ticket, None],
        [None, ticket],
    )


@contextlib.asynccontextmanager
async def two_replicas(redis_url: str, **settings):
    """Routers A and B over the same engines and the same Redis; the engines report to A."""
    # Stub prefill costs 100 us/token and pulls are free: pulling 500 tokens pays (see
    # tests/unit/router/conftest.py for the same calibration).
    cluster = StubCluster(prefill_s_per_token=1e-4)
    # Pulls, not local turns: a holding found through the shared store is pulled by P.
    options = {
        "redis_url": redis_url,
        "cost": {"pull_overhead_s": 0.005},
        "local": {"enabled": False},
        **settings,
    }
    try:
        async with (
            in_process_router(cluster, **options) as a,
            in_process_router(cluster, engines=(a.prefill, a.decode), **options) as b,
        ):
            yield a, b
    finally:
        await cluster.close()


async def test_turn_through_one_replica_reuses_a_holding_made_through_another(redis_url: str):
    async with two_replicas(redis_url) as (a, b):
        first = await a.chat(conversation(1, 500), session="s1")
        second = await b.chat(conversation(2, 500), session="s1", stream=True)
        third = await a.chat(conversation(3, 500), session="s1")

    assert first.headers["x-agentkv-kv-path"] == "recompute"
    assert second.headers["x-agentkv-kv-path"] == "reuse"  # its holding: via A's report
    assert third.headers["x-agentkv-kv-path"] == "reuse"


async def test_a_stream_through_one_replica_ends_when_the_other_records_its_holding(
    redis_url: str,
):
    """B's stream holds back its last event until the turn's holding is recorded, but the
    engine reports to A: A announces the ticket through Redis, so B goes on at once instead of
    waiting out its report timeout (30 s here), and the next turn finds the holding."""
    async with two_replicas(redis_url, timeouts={"report_s": 30.0}) as (a, b):
        await a.chat(conversation(1, 500), session="s1")
        started = time.monotonic()
        second = await b.chat(conversation(2, 500), session="s1", stream=True)
        waited = time.monotonic() - started
        third = await b.chat(conversation(3, 500), session="s1")

    assert second.text.rstrip().endswith("data: [DONE]")
    assert waited < 10.0
    assert third.headers["x-agentkv-kv-path"] == "reuse"


async def test_concurrent_turns_on_two_replicas_never_both_reuse(redis_url: str):
    async with two_replicas(redis_url) as (a, b):
        await a.chat(conversation(1, 500), session="s1")
        a.prefill[0].delay_s = 0.05
        responses = await asyncio.gather(
            a.chat(conversation(2, 500), session="s1"), b.chat(conversation(2, 500), session="s1")
        )

    paths = sorted(r.headers["x-agentkv-kv-path"] for r in responses)
    assert paths == ["recompute", "reuse"]


async def test_session_ended_through_the_other_replica_is_released(redis_url: str):
    async with two_replicas(redis_url) as (a, b):
        await a.chat(conversation(1, 500), session="s1")
        (held_id,) = a.decode[0].retained
        response = await b.client.delete("/v1/sessions/s1")
        assert response.status_code == 200
        assert a.decode[0].released == [held_id]
        assert (await a.client.delete("/v1/sessions/s1")).status_code == 404
        health = (await b.client.get("/health")).json()
    assert health["store"] == "redis"
