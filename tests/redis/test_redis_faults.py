"""Redis going away and routers restarting: turns never fail, and reuse comes back."""

from __future__ import annotations

import asyncio

import pytest

from agentkv_server.testing import StubCluster, conversation, in_process_router

pytestmark = pytest.mark.redis

# As in tests/unit/router/conftest.py: pulling a 500-token history pays on these stubs.
STUB = {"prefill_s_per_token": 1e-4}
# The pull path: a held session found through the store is pulled (the local path is tested with
# stub engines in tests/unit/router/test_local_path.py).
OPTIONS = {
    "cost": {"pull_overhead_s": 0.005},
    "secret": "test-secret",
    "local": {"enabled": False},
}


def paths(responses) -> list[str]:
    assert all(r.status_code == 200 for r in responses)
    return [r.headers["x-agentkv-kv-path"] for r in responses]


async def test_turns_go_on_while_redis_is_down_and_reuse_when_it_is_back(own_redis):
    cluster = StubCluster(**STUB)
    retry_s = 0.2
    try:
        async with in_process_router(
            cluster, redis_url=own_redis.url, store_retry_s=retry_s, **OPTIONS
        ) as router:
            before = [await router.chat(conversation(t, 500), session="s1") for t in (1, 2)]
            own_redis.stop()
            during = [await router.chat(conversation(t, 500), session="s1") for t in (3, 4)]
            down = await router.metric("agentkv_store_up")
            own_redis.start()  # empty: it kept nothing
            await asyncio.sleep(retry_s * 2)
            after = [await router.chat(conversation(t, 500), session="s1") for t in (5, 6)]
            up = await router.metric("agentkv_store_up")
    finally:
        await cluster.close()

    assert paths(before) == ["recompute", "reuse"]
    assert paths(during) == ["recompute", "recompute"]
    assert down == 0 and up == 1
    assert paths(after) == ["recompute", "reuse"]


async def test_a_restarted_router_resumes_reuse_from_redis(redis_url):
    cluster = StubCluster(**STUB)
    try:
        async with in_process_router(cluster, redis_url=redis_url, **OPTIONS) as first:
            engines = (first.prefill, first.decode)
            before = [await first.chat(conversation(t, 500), session="s1") for t in (1, 2)]
        async with in_process_router(
            cluster, engines=engines, redis_url=redis_url, **OPTIONS
        ) as restarted:
            after = [await restarted.chat(conversation(t, 500), session="s1") for t in (3, 4)]
    finally:
        await cluster.close()

    assert paths(before) == ["recompute", "reuse"]
    assert paths(after) == ["reuse", "reuse"]
