"""A client that leaves before its answer is a normal event (issue 50): no ERROR log and no
traceback, counted in ``agentkv_client_disconnects_total{phase}``, and its turn's engine work
stopped. Over a real socket: uvicorn serves the router on loopback."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest

from agentkv_server import wire
from agentkv_server.testing import serve_on_loopback

from .conftest import SECRET

DISCONNECTS = "agentkv_client_disconnects_total"
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def send_and_leave(url: str, path: str, head: dict[str, str], body: bytes, declared: int):
    """Send a POST's headers declaring ``declared`` body bytes and ``body``, then close."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    lines = [f"POST {path} HTTP/1.1", f"host: {address.netloc}", f"content-length: {declared}"]
    lines += [f"{name}: {value}" for name, value in head.items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    return reader, writer


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.02)


async def leave_during_prefill(make_router, chat: dict):
    """A router whose client sent ``chat`` over a socket and left while P computed it (2 s),
    once the router counted the disconnect."""
    router = await make_router()
    router.prefill[0].delay_s = 2.0
    body = json.dumps(chat).encode()
    async with serve_on_loopback(router.app) as url:
        _, writer = await send_and_leave(
            url, "/v1/chat/completions", {"content-type": "application/json"}, body, len(body)
        )
        await wait_for(lambda: _asked(router.prefill[0]))
        writer.close()
        await wait_for(lambda: _counted(router, 1))
    return router


@pytest.mark.parametrize(
    ("path", "head"),
    [
        ("/v1/chat/completions", {"content-type": "application/json"}),
        (wire.REPORT_PATH, {wire.SECRET_HEADER: SECRET}),
    ],
)
async def test_a_client_that_leaves_mid_body_is_counted_not_an_error(
    make_router, errors_logged, path, head
):
    router = await make_router()
    async with serve_on_loopback(router.app) as url:
        for _ in range(3):
            _, writer = await send_and_leave(url, path, head, b'{"model": "stu', declared=500)
            writer.close()
        await wait_for(lambda: _counted(router, 3))

    assert errors_logged == []
    assert router.engine_requests() == 0


async def test_a_plain_turn_whose_client_leaves_is_cancelled(make_router, errors_logged):
    """The client leaves while P computes: the P call's connection closes (vLLM aborts such a
    request) and the D step never starts."""
    router = await leave_during_prefill(make_router, CHAT)
    await asyncio.sleep(0.1)

    assert errors_logged == []
    assert router.decode[0].requests == []
    assert all(engine.inflight == 0 for engine in router.state.prefill.engines)
    samples = (await router.client.get("/metrics", headers={wire.SECRET_HEADER: SECRET})).text
    assert f'{DISCONNECTS}{{phase="turn"}} 1.0' in samples


async def test_a_streamed_turn_whose_client_leaves_before_its_first_chunk_is_cancelled(
    make_router, errors_logged
):
    router = await leave_during_prefill(make_router, {**CHAT, "stream": True})

    assert errors_logged == []
    assert router.decode[0].requests == []


async def test_a_turn_whose_client_stays_is_served_over_the_socket(make_router, errors_logged):
    router = await make_router()
    body = json.dumps(CHAT).encode()
    async with serve_on_loopback(router.app) as url:
        reader, writer = await send_and_leave(
            url, "/v1/chat/completions", {"content-type": "application/json"}, body, len(body)
        )
        status = await reader.readline()
        writer.close()

    assert status.startswith(b"HTTP/1.1 200"), status
    assert await router.metric(DISCONNECTS) == 0
    assert errors_logged == []


async def _counted(router, n: int) -> bool:
    return await router.metric(DISCONNECTS) >= n


async def _asked(engine) -> bool:
    return bool(engine.requests)
