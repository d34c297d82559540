"""The router's HTTP/1.1 client against hostile engines, on real sockets on loopback.

Each peer is a few lines of asyncio that a test scripts: answers from nothing to 64 MiB, with
Content-Length or chunked, written whole or in pieces from 1 B to 1 MiB, fast or paced; closed
before the head, mid-head, mid-body or mid-chunk; garbage; a kept-alive connection closed while
idle; one origin's slow streams beside another's. A property test checks the client's framing
against h11 as the reference parser. Tests wait on events and deadlines, never on sleeps.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv_server.router import http_client
from agentkv_server.router.failures import wire_kind
from agentkv_server.router.http_client import (
    HTTPClient,
    HTTPConnectError,
    HTTPDisconnectError,
    HTTPError,
    HTTPPoolTimeout,
    HTTPProtocolError,
    Timeout,
)

MiB = 1024 * 1024
TIMEOUT = Timeout(total=10.0, connect=2.0)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def with_length(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d OK\r\ncontent-length: %d\r\n\r\n" % (status, len(body)) + body


def chunked(body: bytes, chunk: int) -> bytes:
    out = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
    for start in range(0, len(body), chunk):
        part = body[start : start + chunk]
        out += [b"%x\r\n" % len(part), part, b"\r\n"]
    out.append(b"0\r\n\r\n")
    return b"".join(out)


async def write_in_pieces(
    writer: asyncio.StreamWriter, data: bytes, piece: int, pause_s: float = 0.0
) -> None:
    view = memoryview(data)
    for start in range(0, len(data), piece):
        writer.write(view[start : start + piece])
        await writer.drain()
        if pause_s:
            await asyncio.sleep(pause_s)  # pacing a slow engine, not synchronisation


@dataclass
class Peer:
    """A scripted engine on loopback; ``connections`` counts the connections it accepted."""

    script: Script
    url: str = ""
    connections: int = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
def peer(listen: Callable[..., Awaitable[str]]) -> Callable[[Script], Awaitable[Peer]]:
    async def start(script: Script) -> Peer:
        peer = Peer(script)
        peer.url = await listen(peer.serve)
        return peer

    return start


@pytest.fixture
async def client() -> AsyncIterator[HTTPClient]:
    client = HTTPClient(max_connections=16)
    yield client
    await client.close()


def answers(data: bytes, piece: int | None = None, pause_s: float = 0.0) -> Script:
    """Answer every request on the connection with ``data``, written in pieces."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await write_in_pieces(writer, data, piece or max(len(data), 1), pause_s)

    return script


def idle_connections(client: HTTPClient) -> int:
    return sum(len(pool.idle) for pool in client._pools.values())


async def read_streamed(response: http_client.HTTPResponse) -> bytes:
    parts = []
    while part := await response.readany():
        parts.append(part)
    return b"".join(parts)


_BODIES: dict[int, bytes] = {}


def body_of(size: int) -> bytes:
    if size not in _BODIES:
        _BODIES[size] = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    return _BODIES[size]


# ---- sizes, framing and pieces ---------------------------------------------------------------

# (body size, framing, chunk size for chunked, write piece, pause between pieces)
CASES = [
    (0, "length", 0, None, 0.0),
    (0, "chunked", 1, None, 0.0),
    (1, "length", 0, 1, 0.0),
    (100, "chunked", 3, 1, 0.0),
    (100, "length", 0, 1, 0.001),  # slow: one byte a millisecond
    (1000, "chunked", 17, 7, 0.0),
    (64 * 1024, "chunked", 4096, 1000, 0.0),
    (256 * 1024 + 1, "length", 0, 64 * 1024, 0.0),  # just over the streams' high water
    (MiB, "length", 0, None, 0.0),
    (MiB, "chunked", 65536, 4096, 0.0),
    (4 * MiB, "chunked", MiB, MiB, 0.0),
    (64 * MiB, "length", 0, MiB, 0.0),
    (64 * MiB, "chunked", MiB, MiB, 0.0),
]


def case_id(case: tuple[int, str, int, int | None, float]) -> str:
    size, framing, _, piece, pause_s = case
    return f"{size}B-{framing}-{piece or 'whole'}{'-slow' if pause_s else ''}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
async def test_a_whole_answer_of_any_size_is_read_whole(peer, client, case) -> None:
    size, framing, chunk, piece, pause_s = case
    body = body_of(size)
    wire = with_length(body) if framing == "length" else chunked(body, chunk)
    engine = await peer(answers(wire, piece, pause_s))

    started = time.monotonic()
    answer = await client.fetch(engine.url + "/", TIMEOUT)
    took = time.monotonic() - started

    assert answer.status == 200
    assert len(answer.body) == size and answer.body == body
    assert took < TIMEOUT.total  # a whole read never pauses its engine and waits out the deadline


@pytest.mark.parametrize("size", [MiB, 16 * MiB])
async def test_a_streamed_answer_of_any_size_arrives_whole(peer, client, size) -> None:
    body = body_of(size)
    engine = await peer(answers(chunked(body, 65536), MiB))

    response = await client.post(engine.url + "/", b"{}", {}, TIMEOUT)
    async with response:
        received = await read_streamed(response)

    assert received == body


async def test_a_streamed_answer_holds_its_engine_back_while_the_reader_lags(peer, client) -> None:
    size = 32 * MiB  # more than the kernel's socket buffers hold
    written = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await write_in_pieces(writer, chunked(body_of(size), 65536), 65536)
        written.set()
        await reader.read()

    engine = await peer(script)
    response = await client.post(engine.url + "/", b"{}", {}, TIMEOUT)
    first = await response.readany()

    with pytest.raises(asyncio.TimeoutError):  # the engine cannot write it all: paused
        await asyncio.wait_for(written.wait(), 0.5)
    rest = await read_streamed(response)
    response.release()

    assert first + rest == body_of(size)
    await asyncio.wait_for(written.wait(), 5.0)


async def test_a_whole_read_after_a_lagging_stream_read_resumes_the_engine(peer, client) -> None:
    body = body_of(8 * MiB)
    engine = await peer(answers(chunked(body, 65536), MiB))

    response = await client.post(engine.url + "/", b"{}", {}, TIMEOUT)
    async with response:
        first = await response.readany()
        rest = await response.read()

    assert first + rest == body


async def test_an_answer_with_interim_answers_and_trailers(peer, client) -> None:
    wire = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nX-A:  spaced \t\r\ntransfer-encoding: chunked\r\n\r\n"
        b'5;ext="a b";x\r\nhello\r\n0\r\nx-trailer: late\r\n\r\n'
    )
    engine = await peer(answers(wire, 1))

    answer = await client.fetch(engine.url + "/", TIMEOUT)

    assert (answer.status, answer.body) == (200, b"hello")
    assert answer.headers == {"x-a": "spaced", "transfer-encoding": "chunked"}


# ---- closed early ----------------------------------------------------------------------------

EARLY_CLOSES = {
    "before-head": b"",
    "mid-status-line": b"HTTP/1.1 20",
    "mid-head": b"HTTP/1.1 200 OK\r\ncontent-len",
    "after-head": b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n",
    "mid-body": b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n01234",
    "mid-chunk-size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1",
    "mid-chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\na\r\n01234",
    "between-chunks": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n",
    "before-the-last-crlf": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n",
}


def closes_after(data: bytes, *, reset: bool = False) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if data:
            await write_in_pieces(writer, data, 3)
        if reset:  # RST rather than FIN
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    return script


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("where", sorted(EARLY_CLOSES))
async def test_an_answer_cut_short_is_a_disconnect_not_a_refused_connection(
    peer, client, where, reset
) -> None:
    engine = await peer(closes_after(EARLY_CLOSES[where], reset=reset))

    with pytest.raises(HTTPDisconnectError) as caught:
        await client.fetch(engine.url + "/v1/x", TIMEOUT, json=b"{}")

    assert not isinstance(caught.value, HTTPConnectError)
    assert wire_kind(caught.value) == "disconnect"


async def test_a_stream_cut_mid_chunk_fails_its_reader_with_a_disconnect(peer, client) -> None:
    stream = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\na\r\nxy"
    engine = await peer(closes_after(stream))

    response = await client.post(engine.url + "/", b"{}", {}, TIMEOUT)
    with pytest.raises(HTTPDisconnectError):
        await read_streamed(response)
    response.release()


async def test_a_kept_alive_connection_closed_before_answering_a_post(peer, client) -> None:
    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(with_length(b"{}"))
        await read_request(reader)  # then hang up on the second request

    engine = await peer(answer_once)
    await client.fetch(engine.url + "/v1/x", TIMEOUT, json=b"{}")

    with pytest.raises(HTTPDisconnectError) as caught:
        await client.fetch(engine.url + "/v1/x", TIMEOUT, json=b"{}")

    assert wire_kind(caught.value) == "disconnect"
    assert engine.connections == 1  # a POST is never sent again


async def test_a_refused_connection_is_a_connect_error(client) -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))  # bound, never listening: refused
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/"

        with pytest.raises(HTTPConnectError) as caught:
            await client.fetch(url, TIMEOUT)

    assert wire_kind(caught.value) == "connect"


# ---- garbage ---------------------------------------------------------------------------------

GARBAGE = {
    "ssh": b"SSH-2.0-OpenSSH_9.6\r\n",
    "binary": bytes(range(256)),
    "leading-crlf": b"\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    "bad-status": b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n",
    "status-000": b"HTTP/1.1 000 OK\r\ncontent-length: 0\r\n\r\n",
    "control-in-reason": b"HTTP/1.1 200 O\x0bK\r\ncontent-length: 0\r\n\r\n",
    "header-without-colon": b"HTTP/1.1 200 OK\r\nno colon\r\ncontent-length: 0\r\n\r\n",
    "control-in-header": b"HTTP/1.1 200 OK\r\nx: a\x01b\r\ncontent-length: 0\r\n\r\n",
    "bad-length": b"HTTP/1.1 200 OK\r\ncontent-length: 1x\r\n\r\n1",
    "two-lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n12",
    "length-and-chunked": (
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "bad-chunk-size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    "chunk-without-crlf": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc",
    "gzip-coding": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nxxxx",
    "no-framing": b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil close",
}


def answers_then_holds(data: bytes) -> Script:
    """Write ``data`` and keep the connection open: the client must not wait for a close."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(data)
        await reader.read()

    return script


@pytest.mark.parametrize("name", sorted(GARBAGE))
async def test_garbage_is_a_protocol_error_at_once(peer, client, name) -> None:
    engine = await peer(answers_then_holds(GARBAGE[name]))

    with pytest.raises(HTTPProtocolError) as caught:
        await client.fetch(engine.url + "/", Timeout(total=5.0))

    assert wire_kind(caught.value) == "protocol"


async def test_a_head_without_end_is_cut_off(peer, client) -> None:
    async def endless_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        while True:
            writer.write(b"x-filler: " + b"y" * 1000 + b"\r\n")
            await writer.drain()

    engine = await peer(endless_head)

    with pytest.raises(HTTPProtocolError, match="head over"):
        await client.fetch(engine.url + "/", Timeout(total=5.0))


async def test_an_extra_answer_after_the_answer_is_not_kept(peer, client) -> None:
    engine = await peer(answers(with_length(b"first") + with_length(b"unasked")))

    first = await client.fetch(engine.url + "/", TIMEOUT)
    second = await client.fetch(engine.url + "/", TIMEOUT)

    assert (first.body, second.body) == (b"first", b"first")
    assert engine.connections == 2  # the connection that spoke out of turn was closed


# ---- the pool --------------------------------------------------------------------------------


async def test_a_connection_the_engine_closes_while_idle_leaves_the_pool_at_once(
    peer, client, monkeypatch
) -> None:
    close_now, lost = asyncio.Event(), asyncio.Event()
    original = http_client._Connection.connection_lost

    def spy(connection: http_client._Connection, exc: Exception | None) -> None:
        original(connection, exc)
        lost.set()

    monkeypatch.setattr(http_client._Connection, "connection_lost", spy)

    async def closes_when_told(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(with_length(b"{}"))
        await close_now.wait()

    engine = await peer(closes_when_told)
    await client.fetch(engine.url + "/", TIMEOUT)
    assert idle_connections(client) == 1

    close_now.set()
    await asyncio.wait_for(lost.wait(), 5.0)

    assert idle_connections(client) == 0


def holds_streams(released: asyncio.Event) -> Script:
    """Answer with a stream's head and first chunk, then nothing until ``released``."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n")
            await released.wait()
            writer.write(b"0\r\n\r\n")

    return script


async def test_one_origins_slow_streams_do_not_starve_another(peer) -> None:
    released = asyncio.Event()
    slow = await peer(holds_streams(released))
    fast = await peer(answers(with_length(b"fast")))
    client = HTTPClient(max_connections=3, max_per_origin=2)
    try:
        streams = [await client.post(slow.url + "/", b"{}", {}, TIMEOUT) for _ in range(2)]
        third = asyncio.ensure_future(client.post(slow.url + "/", b"{}", {}, TIMEOUT))
        done, _ = await asyncio.wait({third}, timeout=0.2)
        assert not done  # the slow origin's limit is reached: its third request waits

        answer = await client.fetch(fast.url + "/", Timeout(total=2.0))
        assert answer.body == b"fast"

        released.set()
        for stream in streams:
            assert await stream.read() == b"x"
            stream.release()
        async with await asyncio.wait_for(third, 5.0) as response:
            assert await response.read() == b"x"
    finally:
        await client.close()


async def test_the_deadline_covers_the_wait_for_a_connection(peer) -> None:
    released = asyncio.Event()
    busy = await peer(holds_streams(released))
    other = await peer(answers(with_length(b"{}")))
    client = HTTPClient(max_connections=1)
    try:
        stream = await client.post(busy.url + "/", b"{}", {}, TIMEOUT)

        with pytest.raises(HTTPPoolTimeout) as caught:
            await asyncio.wait_for(client.fetch(other.url + "/", Timeout(total=0.3)), 5.0)
        with pytest.raises(HTTPPoolTimeout):
            await asyncio.wait_for(
                client.fetch(other.url + "/", Timeout(total=60.0, pool=0.2)), 5.0
            )

        assert wire_kind(caught.value) == "router"
        assert other.connections == 0
        stream.release()
        assert (await client.fetch(other.url + "/", TIMEOUT)).body == b"{}"
    finally:
        released.set()
        await client.close()


async def test_a_request_cancelled_while_waiting_for_a_connection_gives_up_its_place(
    peer,
) -> None:
    released = asyncio.Event()
    busy = await peer(holds_streams(released))
    other = await peer(answers(with_length(b"{}")))
    client = HTTPClient(max_connections=1)
    try:
        stream = await client.post(busy.url + "/", b"{}", {}, TIMEOUT)
        waiting = asyncio.ensure_future(client.fetch(other.url + "/", TIMEOUT))
        done, _ = await asyncio.wait({waiting}, timeout=0.1)
        assert not done
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

        stream.release()
        answer = await asyncio.wait_for(client.fetch(other.url + "/", TIMEOUT), 5.0)

        assert answer.body == b"{}"
    finally:
        released.set()
        await client.close()


async def test_one_deadline_runs_from_the_request_start_through_the_pool_wait(peer) -> None:
    """A request that waited for its connection has only what is left of its deadline."""
    released, arrived = asyncio.Event(), asyncio.Event()
    busy = await peer(holds_streams(released))

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()
        await reader.read()

    other = await peer(silent)
    client = HTTPClient(max_connections=1)
    loop = asyncio.get_running_loop()
    try:
        stream = await client.post(busy.url + "/", b"{}", {}, TIMEOUT)
        loop.call_later(1.0, stream.release)
        started = time.monotonic()
        request = asyncio.ensure_future(client.fetch(other.url + "/", Timeout(total=2.0)))
        await asyncio.wait_for(arrived.wait(), 5.0)
        sent = time.monotonic()

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(request, 5.0)

        ended = time.monotonic()
        assert sent - started >= 0.9  # it did wait for the connection
        assert ended - sent < 1.8  # and then had only what was left of its 2 s
    finally:
        released.set()
        await client.close()


async def test_a_router_that_cannot_open_a_socket_fails_as_itself(client, monkeypatch) -> None:
    loop = asyncio.get_running_loop()

    async def out_of_descriptors(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(loop, "create_connection", out_of_descriptors)

    with pytest.raises(http_client.HTTPLocalError) as caught:
        await client.fetch("http://127.0.0.1:9/", TIMEOUT)

    assert not isinstance(caught.value, HTTPConnectError)
    assert wire_kind(caught.value) == "router"


# ---- framing against h11 ---------------------------------------------------------------------

TOKEN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~"
FIELD_BYTES = bytes([*range(0x21, 0x7F), *range(0x80, 0x100)])
FRAMING = {"content-length", "transfer-encoding"}
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

tokens = st.text(alphabet=TOKEN, min_size=1, max_size=10)
ows = st.sampled_from([b"", b" ", b"\t", b" \t "])


@st.composite
def field_values(draw: st.DrawFn) -> bytes:
    words = draw(st.lists(st.binary(min_size=1, max_size=6).map(_visible), max_size=3))
    return draw(ows) + b" ".join(words) + draw(ows)


def _visible(raw: bytes) -> bytes:
    return bytes(FIELD_BYTES[b % len(FIELD_BYTES)] for b in raw)


@st.composite
def headers(draw: st.DrawFn) -> list[bytes]:
    names = draw(st.lists(tokens.filter(lambda n: n.lower() not in FRAMING), max_size=5))
    return [name.encode() + b":" + draw(field_values()) for name in names]


@st.composite
def chunk_extensions(draw: st.DrawFn) -> bytes:
    out = b""
    for name in draw(st.lists(tokens, max_size=2)):
        out += b";" + name.encode()
        kind = draw(st.sampled_from(["bare", "token", "quoted"]))
        if kind == "token":
            out += b"=" + draw(tokens).encode()
        elif kind == "quoted":
            out += b'="' + draw(st.text(alphabet=TOKEN + " ", max_size=8)).encode() + b'"'
    return out


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    """A valid HTTP/1.1 answer: interim answers, then one that says where it ends."""
    out = b""
    for status in draw(st.lists(st.sampled_from([100, 102, 103]), max_size=2)):
        out += b"HTTP/1.1 %d Interim\r\n" % status + b"".join(
            line + b"\r\n" for line in draw(headers())
        )
        out += b"\r\n"
    status = draw(st.integers(200, 599).filter(lambda s: s not in (204, 304)))
    reason = draw(st.binary(max_size=12).map(_visible))
    lines = [b"HTTP/1.1 %d %s" % (status, reason), *draw(headers())]
    body_parts = draw(st.lists(st.binary(min_size=1, max_size=300), max_size=6))
    body = b"".join(body_parts)
    if draw(st.booleans()):
        lines.insert(
            draw(st.integers(1, len(lines))),
            draw(st.sampled_from([b"content-length", b"Content-Length"]))
            + b":"
            + draw(ows)
            + b"%d" % len(body),
        )
        return out + b"\r\n".join(lines) + b"\r\n\r\n" + body
    lines.insert(
        draw(st.integers(1, len(lines))),
        b"transfer-encoding: " + draw(st.sampled_from([b"chunked", b"Chunked", b"CHUNKED"])),
    )
    out += b"\r\n".join(lines) + b"\r\n\r\n"
    for part in body_parts:
        size = draw(st.sampled_from([b"%x", b"%X", b"0%x"])) % len(part)
        out += size + draw(chunk_extensions()) + b"\r\n" + part + b"\r\n"
    out += b"0" + draw(chunk_extensions()) + b"\r\n"
    out += b"".join(line + b"\r\n" for line in draw(headers()))  # trailers
    return out + b"\r\n"


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid answer with one byte changed, added or removed, or cut short."""
    data = draw(responses())
    at = draw(st.integers(0, len(data) - 1))
    byte = bytes([draw(st.integers(0, 255))])
    how = draw(st.sampled_from(["replace", "insert", "delete", "cut"]))
    if how == "replace":
        return data[:at] + byte + data[at + 1 :]
    if how == "insert":
        return data[:at] + byte + data[at:]
    if how == "delete":
        return data[:at] + data[at + 1 :]
    return data[:at]


@dataclass(frozen=True)
class Parsed:
    status: int
    headers: dict[str, str]
    body: bytes


def h11_parse(data: bytes) -> Parsed | str:
    """h11's reading of ``data`` followed by the connection's close: the answer, or
    ``"reject"`` (not HTTP), ``"incomplete"`` (cut short) or ``"until-close"`` (no framing)."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    connection.send(h11.EndOfMessage())
    head: h11.Response | None = None
    body = b""

    def ended() -> bool:
        nonlocal head, body
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return False
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return True

    try:
        if data:  # (b"" would say the connection closed)
            connection.receive_data(data)
        if ended():
            assert head is not None
            headers = {n.decode("latin-1"): v.decode("latin-1") for n, v in head.headers}
            return Parsed(head.status_code, headers, body)
    except h11.RemoteProtocolError:
        return "reject"
    try:
        connection.receive_data(b"")
        return "until-close" if ended() else "incomplete"
    except h11.RemoteProtocolError:
        return "incomplete"


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


async def client_parse(data: bytes, cuts: list[int]) -> Parsed | BaseException:
    """The client's reading of ``data``, written in pieces and then closed."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for piece in splits(data, cuts):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)  # let the pieces arrive one by one
        writer.close()

    server = await asyncio.start_server(lambda r, w: Peer(script).serve(r, w), "127.0.0.1", 0)
    client = HTTPClient()
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        answer = await client.fetch(url, Timeout(total=5.0))
        headers = dict(answer.headers)
        if "transfer-encoding" in headers:  # h11 writes the coding in lower case
            headers["transfer-encoding"] = headers["transfer-encoding"].lower()
        return Parsed(answer.status, headers, answer.body)
    except HTTPError as exc:
        return exc
    finally:
        await client.close()
        server.close()


cut_points = st.lists(st.integers(0, 10_000), max_size=8)


@PROPERTY
@given(data=responses(), cuts=cut_points)
async def test_the_client_reads_a_valid_answer_as_h11_does(data: bytes, cuts: list[int]) -> None:
    expected = h11_parse(data)
    assert isinstance(expected, Parsed), expected  # the strategy makes only valid answers

    assert await client_parse(data, cuts) == expected


@PROPERTY
@given(data=mutated(), cuts=cut_points)
async def test_the_client_never_returns_what_h11_would_not(data: bytes, cuts: list[int]) -> None:
    expected = h11_parse(data)
    got = await client_parse(data, cuts)

    if isinstance(expected, Parsed):  # the client may be stricter, never different
        assert got == expected or isinstance(got, HTTPProtocolError), got
    elif expected == "incomplete":
        assert isinstance(got, (HTTPDisconnectError, HTTPProtocolError)), got
    else:  # "reject", "until-close"
        assert isinstance(got, HTTPProtocolError), (expected, got)
