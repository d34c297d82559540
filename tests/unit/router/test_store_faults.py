"""A session store that fails (Redis unreachable): turns go on by recompute, and say so."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import ConnectionError as RedisConnectionError

from agentkv_server.router import Holding, InMemoryStore
from agentkv_server.testing import conversation


class FlakyStore(InMemoryStore):
    """An in-memory store that raises like an unreachable Redis while ``down``."""

    def __init__(self) -> None:
        super().__init__(max_sessions=100, ticket_ttl_s=60.0)
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    async def take(self, session_id: str) -> Holding | None:
        self._check()
        return await super().take(session_id)

    async def offer(self, holding: Holding) -> list[Holding]:
        self._check()
        return await super().offer(holding)

    async def count(self) -> int:
        self._check()
        return await super().count()


async def test_turns_recompute_while_the_store_is_down(make_router, caplog):
    store = FlakyStore()
    router = await make_router(store=store, store_retry_s=3600.0)
    await router.chat(conversation(1, 500), session="s1")
    store.down = True

    with caplog.at_level(logging.WARNING, logger="agentkv_server.router"):
        responses = [await router.chat(conversation(t, 500), session="s1") for t in (2, 3)]

    assert [r.status_code for r in responses] == [200, 200]
    assert [r.headers["x-agentkv-kv-path"] for r in responses] == ["recompute", "recompute"]
    assert await router.metric("agentkv_store_up") == 0
    assert await router.metric("agentkv_store_errors_total") == 1  # then not tried again
    assert sum("serving without it" in m for m in caplog.messages) == 1
    health = (await router.client.get("/health")).json()
    assert health["status"] == "degraded" and health["store_available"] is False
    deleted = await router.client.delete("/v1/sessions/s1")
    assert deleted.status_code == 503 and deleted.json()["error"]["code"] == "store_unavailable"


async def test_engines_keep_no_kv_that_nothing_could_record(make_router):
    store = FlakyStore()
    router = await make_router(store=store, store_retry_s=3600.0)
    store.down = True

    await router.chat(conversation(1, 500), session="s1")

    decode_step = router.decode[0].completions()[-1]
    assert decode_step.kv_params["agentkv_retention_seconds"] == 0
    assert "agentkv_ticket" not in decode_step.kv_params
    assert router.decode[0].retained == {}


async def test_reuse_resumes_when_the_store_is_back(make_router, caplog):
    store = FlakyStore()
    router = await make_router(store=store, store_retry_s=0.05)
    store.down = True
    await router.chat(conversation(1, 500), session="s1")
    store.down = False
    await asyncio.sleep(0.1)  # past store_retry_s

    with caplog.at_level(logging.WARNING, logger="agentkv_server.router"):
        second = await router.chat(conversation(2, 500), session="s1")
    third = await router.chat(conversation(3, 500), session="s1")

    assert second.headers["x-agentkv-kv-path"] == "recompute"  # nothing was held
    assert third.headers["x-agentkv-kv-path"] == "reuse"
    assert await router.metric("agentkv_store_up") == 1
    assert any("store is back" in m for m in caplog.messages)
