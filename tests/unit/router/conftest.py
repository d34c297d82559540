"""Router apps driven in-process in front of stub engines on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from agentkv_server.testing import StubCluster
from agentkv_server.testing.harness import InProcessRouter, in_process_router

SECRET = "test-secret"
# The stub model prefills at 100 us/token and pulls for free; a prior pull overhead of 5 ms
# (instead of the 50 ms default, sized for real engines) lets a 500-token history be pulled.
STUB_PREFILL_S_PER_TOKEN = 1e-4
STUB_COST = {"pull_overhead_s": 0.005}
# Most tests here exercise the pull and recompute paths; the local path's own tests
# (test_local_path.py) turn it on.
PULL_ONLY = {"enabled": False}

MakeRouter = Callable[..., Awaitable[InProcessRouter]]
Connected = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Listen = Callable[[Connected], Awaitable[str]]


@pytest.fixture
async def listen() -> AsyncIterator[Listen]:
    """``await listen(on_connection)``: the ``http://`` URL of a loopback server that runs
    ``on_connection`` per connection; every server closes at the test's end."""
    servers: list[asyncio.base_events.Server] = []

    async def start(on_connection: Connected) -> str:
        server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def make_router() -> AsyncIterator[MakeRouter]:
    """``await make_router(n_prefill=1, n_decode=1, **settings)``: a router over new stubs."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(n_prefill: int = 1, n_decode: int = 1, **settings: Any) -> InProcessRouter:
            cluster = StubCluster(prefill_s_per_token=STUB_PREFILL_S_PER_TOKEN)
            stack.push_async_callback(cluster.close)
            options = {"secret": SECRET, "cost": STUB_COST, "local": PULL_ONLY} | settings
            return await stack.enter_async_context(
                in_process_router(cluster, n_prefill=n_prefill, n_decode=n_decode, **options)
            )

        yield make


@pytest.fixture
def errors_logged() -> Iterator[list[str]]:
    """``logger: message`` of each ERROR record logged during the test, the app's and
    uvicorn's (whose loggers do not propagate to the root logger once it configured them)."""
    logged: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(f"{record.name}: {record.getMessage()}")  # type: ignore[method-assign]
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    yield logged
    for logger in loggers:
        logger.removeHandler(handler)
