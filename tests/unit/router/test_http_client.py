"""The router's HTTP/1.1 client against real sockets on loopback.

The server here is a few lines of asyncio that answer exactly what each test scripts (a plain
or chunked answer, a close without one, garbage, silence), so every path of the client meets
what an engine could send.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from agentkv_server.router import http_client
from agentkv_server.router.http_client import (
    HTTPClient,
    HTTPConnectError,
    HTTPConnectionError,
    HTTPProtocolError,
    Timeout,
)
from agentkv_server.testing.conditions import eventually

TIMEOUT = Timeout(total=5.0, connect=2.0)

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]


def answer(body: bytes, status: int = 200, *, close: bool = False) -> bytes:
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\n" + ("connection: close\r\n" if close else "")
    return head.encode() + b"\r\n" + body


def chunked(*parts: bytes) -> bytes:
    out = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for part in parts:
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return out + b"0\r\n\r\n"


@dataclass
class Server:
    """Counts connections and requests; ``handler`` answers each request (False: hang up)."""

    handler: Handler
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: int = 0
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.handler(request, writer):
                    writer.close()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
            writer.close()


@pytest.fixture
def serve(listen: Callable[..., Awaitable[str]]) -> Callable[[Handler], Awaitable[Server]]:
    async def start(handler: Handler) -> Server:
        server = Server(handler)
        server.url = await listen(server.serve)
        return server

    return start


@pytest.fixture
async def client() -> AsyncIterator[HTTPClient]:
    client = HTTPClient(max_connections=8)
    yield client
    await client.close()


def replies(data: bytes) -> Handler:
    async def handler(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        return True

    return handler


async def test_keeps_the_connection_alive_across_requests(serve, client) -> None:
    server = await serve(replies(answer(b'{"ok": 1}')))

    first = await client.fetch(server.url + "/v1/x", TIMEOUT, json=b"{}", headers={"a": "b"})
    second = await client.fetch(server.url + "/health", TIMEOUT)

    assert (first.status, first.body, first.headers["content-type"]) == (
        200,
        b'{"ok": 1}',
        "application/json",
    )
    assert second.body == b'{"ok": 1}'
    assert server.connections == 1
    post, get = server.requests
    assert post.startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"\r\na: b\r\n" in post and b"Content-Type: application/json" in post
    assert post.endswith(b"\r\n\r\n{}")
    assert get.startswith(b"GET /health HTTP/1.1\r\n") and b"Content-Length" not in get


async def test_reads_a_chunked_answer_as_it_arrives(serve, client) -> None:
    parts = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    server = await serve(replies(chunked(*parts)))

    response = await client.post(server.url + "/v1/s", b"{}", {}, TIMEOUT)
    received = b""
    while chunk := await response.readany():
        received += chunk
    response.release()

    assert response.headers["content-type"] == "text/event-stream"
    assert received == b"".join(parts)
    again = await client.fetch(server.url + "/v1/s", TIMEOUT, json=b"{}")
    assert again.body == b"".join(parts) and server.connections == 1


async def test_a_post_the_engine_hangs_up_on_is_not_sent_again(serve, client) -> None:
    async def hang_up(request: bytes, writer: asyncio.StreamWriter) -> bool:
        return False

    server = await serve(hang_up)

    with pytest.raises(HTTPConnectionError):
        await client.fetch(server.url + "/v1/x", TIMEOUT, json=b"{}")
    assert len(server.requests) == 1


async def test_a_get_the_engine_hangs_up_on_is_sent_again_on_a_new_connection(
    serve, client
) -> None:
    """As an engine closing an idle keep-alive connection just as the request went out."""

    async def hang_up_on_the_second(request: bytes, writer: asyncio.StreamWriter) -> bool:
        if len(server.requests) == 2:
            return False
        writer.write(answer(b"{}"))
        return True

    server = await serve(hang_up_on_the_second)
    await client.fetch(server.url + "/health", TIMEOUT)

    again = await client.fetch(server.url + "/health", TIMEOUT)

    assert again.status == 200
    assert (server.connections, len(server.requests)) == (2, 3)


async def test_a_refused_connection_is_a_connect_error(client) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: refused

        with pytest.raises(HTTPConnectError, match="cannot connect"):
            await client.fetch(f"http://127.0.0.1:{port}/health", TIMEOUT)


async def test_total_timeout_ends_the_request_and_closes_its_connection(serve, client) -> None:
    async def silent(request: bytes, writer: asyncio.StreamWriter) -> bool:
        return True

    server = await serve(silent)
    started = time.monotonic()

    with pytest.raises(asyncio.TimeoutError):
        await client.fetch(server.url + "/v1/x", Timeout(total=0.2), json=b"{}")

    assert time.monotonic() - started < 2.0
    await eventually(lambda: server.closed_by_client == 1, "closed by the client")
    assert server.connections == 1


async def test_a_stream_idle_for_longer_than_asked_times_out(serve, client) -> None:
    head_only = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
    server = await serve(replies(head_only))

    response = await client.post(server.url + "/v1/s", b"{}", {}, TIMEOUT)
    assert await response.readany(0.5) == b"hello"
    with pytest.raises(asyncio.TimeoutError):
        await response.readany(0.1)
    response.release()

    # An unfinished answer's connection is not reused: released, it is closed.
    await eventually(lambda: server.closed_by_client == 1, "closed by the client")


async def test_an_answer_that_is_not_http_is_a_protocol_error(serve, client) -> None:
    server = await serve(replies(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"))

    with pytest.raises(HTTPProtocolError):
        await client.fetch(server.url + "/health", TIMEOUT)


async def test_an_error_status_comes_back_with_its_body(serve, client) -> None:
    server = await serve(replies(answer(b'{"error": "no"}', 400, close=True)))

    refused = await client.fetch(server.url + "/v1/x", TIMEOUT, json=b"{}")
    again = await client.fetch(server.url + "/v1/x", TIMEOUT, json=b"{}")

    assert (refused.status, refused.body) == (400, b'{"error": "no"}')
    assert again.status == 400 and server.connections == 2  # "connection: close" honoured


async def test_at_most_max_connections_are_in_use(serve) -> None:
    server = await serve(replies(chunked(b"x")))
    client = HTTPClient(max_connections=2)
    try:
        held = [await client.post(server.url + "/", b"{}", {}, TIMEOUT) for _ in range(2)]
        third = asyncio.ensure_future(client.post(server.url + "/", b"{}", {}, TIMEOUT))
        # That nothing happens can only be watched for a while; a slow machine can make this
        # check miss a bug, never fail a correct client.
        done, _ = await asyncio.wait({third}, timeout=0.1)
        assert not done and server.connections == 2

        await held[0].read()
        held[0].release()
        response = await asyncio.wait_for(third, 2.0)

        assert await response.read() == b"x"
        response.release()
        held[1].release()
    finally:
        await client.close()


async def test_a_connection_idle_too_long_is_not_reused(serve, client, monkeypatch) -> None:
    monkeypatch.setattr(http_client, "_IDLE_S", 0.05)
    server = await serve(replies(answer(b"{}")))

    await client.fetch(server.url + "/health", TIMEOUT)
    await asyncio.sleep(0.1)  # the scenario: idle for longer than _IDLE_S
    await client.fetch(server.url + "/health", TIMEOUT)

    assert server.connections == 2


async def test_a_header_with_a_line_break_is_refused_before_sending(serve, client) -> None:
    server = await serve(replies(answer(b"{}")))

    with pytest.raises(ValueError, match="line break"):
        await client.fetch(server.url + "/", TIMEOUT, json=b"{}", headers={"x": "a\r\nb: c"})
    assert server.requests == []


async def test_a_large_body_arrives_whole(serve, client) -> None:
    server = await serve(replies(answer(b"{}")))
    body = b'{"prompt": "' + b"x" * 200_000 + b'"}'

    await client.fetch(server.url + "/v1/completions", TIMEOUT, json=body)

    (request,) = server.requests
    assert request.endswith(b"\r\n\r\n" + body)
    assert f"Content-Length: {len(body)}".encode() in request
