"""The router's HTTP/1.1 client for its calls to engines: keep-alive connections on asyncio
protocols, responses parsed by httptools (the parser uvicorn serves the router's own side with).

Why not aiohttp: its client was the largest share of the router's CPU per turn (37-47% of the
samples; on Python 3.11 it also starts a task per request to write the body), and a turn makes
two to four engine calls. This client does only what those calls need (POST or GET of a whole
body, a plain or chunked answer read whole or as it arrives, a connect and a total timeout);
with it the router's CPU per P/D turn fell by about half (docs/router.md, "Hot path"). Answers
must say where they end (Content-Length or chunked, as uvicorn's and aiohttp's do); one that
runs until the connection closes reads as a broken connection.

Failures (:class:`HTTPError`): :class:`HTTPConnectionError` (could not connect, or the
connection broke), ``asyncio.TimeoutError`` (the connect or total timeout passed; the connection
is closed), and :class:`HTTPProtocolError` (an answer that is not HTTP).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools
from typing_extensions import Self

__all__ = [
    "Answer",
    "HTTPClient",
    "HTTPConnectError",
    "HTTPConnectionError",
    "HTTPError",
    "HTTPProtocolError",
    "HTTPResponse",
    "Timeout",
]

# Streamed answers: stop reading from the engine while this much is waiting for the client.
_HIGH_WATER = 256 * 1024
# A body smaller than this is copied behind the head and sent with it; a larger one follows it.
_JOIN_BELOW = 64 * 1024
# An idle connection is not reused after this long: uvicorn (vLLM's server) closes idle ones
# after 5 s, and a request sent as it does would fail for nothing.
_IDLE_S = 4.0


class HTTPError(Exception):
    """An engine call that failed on the wire (timeouts are ``asyncio.TimeoutError``)."""


class HTTPConnectionError(HTTPError, ConnectionError):
    """The engine could not be connected to, or the connection broke before the answer ended."""


class HTTPConnectError(HTTPConnectionError):
    """No connection could be made (refused, unreachable); not within the connect timeout is
    ``asyncio.TimeoutError``."""


class HTTPProtocolError(HTTPError):
    """The engine's answer is not valid HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Timeout:
    """``total``: from the request's start to its answer's end; ``connect``: a new connection."""

    total: float | None = None
    connect: float | None = None

    @property
    def connect_s(self) -> float | None:
        """A new connection's bound: ``connect``, within ``total``."""
        bounds = [bound for bound in (self.connect, self.total) if bound is not None]
        return min(bounds) if bounds else None


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer."""

    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> tuple[_Origin, str]:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"not an http:// URL: {url!r}")
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.hostname, parts.port or 80), path


class HTTPResponse:
    """An answer whose status and headers have arrived; its body arrives behind them.

    Read it whole (:meth:`read`) or as it comes (:meth:`readany`), then :meth:`release` it (or
    use ``async with``): a finished answer's connection goes back to the pool, an unfinished
    one's is closed.
    """

    status: int
    headers: dict[str, str]  # names in lower case

    def __init__(self, connection: _Connection, on_release: Callable[[], None]) -> None:
        self._connection = connection
        self._on_release = on_release
        self.status = 0
        self.headers = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    async def read(self) -> bytes:
        """The whole body."""
        while not self._done:
            await self._wait()
        if self._error is not None:
            raise self._error
        return self._take()

    async def readany(self, timeout: float | None = None) -> bytes:
        """What has arrived since the last call (waiting for something); ``b""`` at the end.

        ``asyncio.TimeoutError`` when nothing arrives within ``timeout`` seconds.
        """
        while not self._chunks and not self._done:
            await self._wait(timeout)
        return self._take()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._connection.finish(reusable=self._done and self._error is None)
            self._on_release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def _take(self) -> bytes:
        if self._error is not None and not self._chunks:
            raise self._error
        data = b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > _HIGH_WATER:
            self._connection.resume_reading()
        self._buffered = 0
        return data

    async def _wait(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        # A timer, not asyncio.wait_for: that starts a task per call, and a stream waits per chunk.
        timer = None if timeout is None else loop.call_later(timeout, _time_out, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._wake()


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: HTTPResponse | None = None
        self._head: asyncio.Future[HTTPResponse] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.closed = False
        self.idle_since = 0.0
        self.answered = False  # any byte of an answer to the current request

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abort(HTTPProtocolError(f"invalid HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        detail = f"connection lost: {exc}" if exc else "the engine closed the connection"
        self._abort(HTTPConnectionError(detail))

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._response is None:  # an answer nobody asked for
            self._abort(HTTPProtocolError("answer without a request"))
            return
        self._response.headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._response is not None
        self._response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self._response
        assert response is not None
        response.status = self._parser.get_status_code()
        if response.status < 200:  # 100 Continue and the like: the real answer follows
            return
        if self._head is not None and not self._head.done():
            self._head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None and self._response.status >= 200:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        if response is None or response.status < 200:
            return
        self._cancel_deadline()
        if not self._parser.should_keep_alive():
            self.closed = True
        response._finish()

    # the client's side

    async def send(
        self, head: bytes, body: bytes, total: float | None, on_release: Callable[[], None]
    ) -> HTTPResponse:
        assert self._transport is not None
        loop = asyncio.get_running_loop()
        self._response = HTTPResponse(self, on_release)
        self._head = loop.create_future()
        self.answered = False
        if total is not None:
            self._deadline = loop.call_later(total, self._time_out)
        if len(body) < _JOIN_BELOW:  # one send: head and body in one segment
            self._transport.write(head + body)
        else:
            self._transport.writelines((head, body))
        try:
            return await self._head
        except BaseException:
            self.finish(reusable=False)
            raise

    def finish(self, *, reusable: bool) -> None:
        self._cancel_deadline()
        self._response = None
        self._head = None
        if reusable and not self.closed:
            self._pool.put_back(self)
        else:
            self.close()
            self._pool.forget(self)

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def pause_reading(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _time_out(self) -> None:
        self._deadline = None
        self._abort(asyncio.TimeoutError())
        self.close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _abort(self, error: BaseException) -> None:
        self._cancel_deadline()
        self.closed = True
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        if self._response is not None:
            self._response._fail(error)
        if self._transport is not None:
            self._transport.close()


class _Pool:
    """Idle connections to one origin, the most recently used first."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.idle: list[_Connection] = []
        self.opened: set[_Connection] = set()

    def take(self) -> _Connection | None:
        fresh_since = time.monotonic() - _IDLE_S
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and connection.idle_since > fresh_since:
                return connection
            connection.close()
            self.opened.discard(connection)
        return None

    def put_back(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self.idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        self.opened.discard(connection)

    def close(self) -> None:
        for connection in list(self.opened):
            connection.close()
        self.opened.clear()
        self.idle.clear()


class HTTPClient:
    """Keep-alive connections to any number of engines, at most ``max_connections`` in use."""

    def __init__(self, *, max_connections: int = 100, user_agent: str = "agentkv-router") -> None:
        self._pools: dict[_Origin, _Pool] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._user_agent = user_agent
        self._closed = False

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout: Timeout
    ) -> HTTPResponse:
        """POST ``body`` (JSON); returns once the answer's status and headers arrived."""
        return await self.request("POST", url, body, headers, timeout, "application/json")

    async def fetch(
        self,
        url: str,
        timeout: Timeout,
        *,
        json: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Answer:
        """The whole answer to a GET, or to a POST of the JSON body ``json``."""
        if json is None:
            response = await self.request("GET", url, b"", headers or {}, timeout)
        else:
            response = await self.post(url, json, headers or {}, timeout)
        async with response:
            return Answer(response.status, response.headers, await response.read())

    async def request(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout: Timeout,
        content_type: str | None = None,
    ) -> HTTPResponse:
        if self._closed:
            raise RuntimeError("the HTTP client is closed")
        origin, path = _Origin.parse(url)
        head = _request_head(
            method, path, origin, headers, len(body), content_type, self._user_agent
        )
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(origin)
        await self._slots.acquire()
        try:
            return await self._send(pool, head, body, timeout, idempotent=method == "GET")
        except BaseException:
            self._slots.release()
            raise

    async def _send(
        self, pool: _Pool, head: bytes, body: bytes, timeout: Timeout, idempotent: bool
    ) -> HTTPResponse:
        # A kept-alive connection may have been closed by the engine a moment ago. A GET that
        # meets one is sent again on a new connection; a POST never is (the engine may have
        # acted on it before closing).
        if (connection := pool.take()) is not None:
            try:
                return await connection.send(head, body, timeout.total, self._slots.release)
            except HTTPConnectionError:
                if not idempotent or connection.answered:
                    raise
        connection = await self._connect(pool, timeout.connect_s)
        return await connection.send(head, body, timeout.total, self._slots.release)

    async def _connect(self, pool: _Pool, timeout_s: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        origin = pool.origin
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(pool), origin.host, origin.port),
                timeout_s,
            )
        except asyncio.TimeoutError:  # an OSError too, and it stays what it is
            raise
        except OSError as exc:
            raise HTTPConnectError(
                f"cannot connect to {origin.host}:{origin.port}: {exc.strerror or exc}"
            ) from exc
        pool.opened.add(connection)
        return connection

    async def close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _request_head(
    method: str,
    path: str,
    origin: _Origin,
    headers: Mapping[str, str],
    length: int,
    content_type: str | None,
    user_agent: str,
) -> bytes:
    host = f"[{origin.host}]" if ":" in origin.host else origin.host  # IPv6
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{origin.port}"]
    lines.append(f"User-Agent: {user_agent}")
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if method != "GET" or length:
        lines.append(f"Content-Length: {length}")
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
