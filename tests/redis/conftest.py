"""Real redis-server processes: one shared per test session, and a private one per test for
tests that stop and restart it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from agentkv_server.testing import RedisServer
from agentkv_server.testing.conditions import require


def require_redis_server() -> None:
    """CI installs redis-server (scripts/install --dev): a missing binary fails there."""
    require(
        None
        if RedisServer.available()
        else "redis-server binary not found: scripts/install --dev installs it (apt)"
    )


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a redis-server shared by the session's tests, stopped after the session."""
    require_redis_server()
    with RedisServer() as server:
        yield server.url


@pytest.fixture
async def redis_url(redis_server: str) -> AsyncIterator[str]:
    """The shared server's URL, with an empty database for each test."""
    client = Redis.from_url(redis_server)
    await client.flushdb()
    await client.aclose()
    yield redis_server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A running redis-server of this test's own; the test may stop and restart it."""
    require_redis_server()
    with RedisServer() as server:
        yield server
