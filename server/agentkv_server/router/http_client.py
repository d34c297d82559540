"""The router's HTTP/1.1 client for its calls to engines: keep-alive connections on asyncio
protocols, answers parsed by httptools. It does only what engine calls need, so that a call
costs the router little CPU (docs/router.md, "Upstream calls" and "Hot path").

One deadline bounds each request from its start: the wait for a free connection, the connect,
the write and the read. Every failure says whose it is (docs/router.md, "Which failures blame
an engine"): :class:`HTTPConnectError` (no new connection: the engine is gone),
:class:`HTTPDisconnectError` (the engine closed a connection before its answer ended),
``asyncio.TimeoutError`` (no answer in time), :class:`HTTPProtocolError` (an answer that is not
HTTP, or over this client's limits) and :class:`HTTPLocalError` (the router's own: no free
connection in time, no socket). Answers must say where they end (Content-Length or chunked);
one that does not is a protocol error at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import math
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
    "HTTPDisconnectError",
    "HTTPError",
    "HTTPLocalError",
    "HTTPPoolTimeout",
    "HTTPProtocolError",
    "HTTPResponse",
    "Timeout",
]

# Streamed answers: stop reading from the engine while this much is waiting for the reader.
_HIGH_WATER = 256 * 1024
# An answer whose status line and headers run longer than this is refused.
_MAX_HEAD = 64 * 1024
# A body smaller than this is copied behind the head and sent with it; a larger one follows it.
_JOIN_BELOW = 64 * 1024
# An idle connection is not reused after this long: uvicorn (vLLM's server) closes idle ones
# after 5 s, and a request sent as it does would fail for nothing.
_IDLE_S = 4.0
# What a reason phrase may hold (RFC 9112: HTAB, SP, VCHAR, obs-text).
_REASON_BYTES = bytes([9, *range(0x20, 0x7F), *range(0x80, 0x100)])
# Connect failures that are the router's own (out of descriptors, buffers or ports).
_LOCAL_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL}
)


class HTTPError(Exception):
    """An engine call that failed on the wire (timeouts are ``asyncio.TimeoutError``)."""


class HTTPConnectionError(HTTPError, ConnectionError):
    """No connection to the engine, or the connection broke before the answer ended."""


class HTTPConnectError(HTTPConnectionError):
    """A new connection was refused or could not reach the engine. Not within the connect
    timeout is ``asyncio.TimeoutError``."""


class HTTPDisconnectError(HTTPConnectionError):
    """The engine closed or reset the connection before its answer ended."""


class HTTPProtocolError(HTTPError):
    """The engine's answer is not valid HTTP/1.1, or exceeds this client's limits."""


class HTTPLocalError(HTTPError):
    """The router could not make the call itself; never the engine's failure."""


class HTTPPoolTimeout(HTTPLocalError):
    """No connection slot came free before the request's deadline."""


@dataclass(frozen=True, slots=True)
class Timeout:
    """One request's bounds in seconds. ``total``, ``head`` and ``pool`` run from the request's
    start: to its answer's end, to its answer's status and headers, to a free connection slot
    (each within the one before). ``connect`` bounds a new connection's handshake, within
    ``head``."""

    total: float | None = None
    connect: float | None = None
    pool: float | None = None
    head: float | None = None


def _deadlines(timeout: Timeout, now: float) -> tuple[float, float, float]:
    """The loop times by which a request started at ``now`` must have its whole answer, its
    answer's head and a connection slot; ``math.inf`` where unbounded."""
    answer = head = _after(now, timeout.total)
    if timeout.head is not None:
        head = min(answer, now + timeout.head)
    if timeout.pool is None:
        return answer, head, head
    return answer, head, min(head, now + timeout.pool)


def _after(now: float, seconds: float | None) -> float:
    return math.inf if seconds is None else now + seconds


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
    @functools.lru_cache(maxsize=1024)  # a router calls a few paths on a few engines
    def parse(cls, url: str) -> tuple[_Origin, str]:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"not an http:// URL: {url!r}")
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.hostname, parts.port or 80), path

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class HTTPResponse:
    """An answer whose status and headers have arrived; its body arrives behind them.

    Read it whole (:meth:`read`) or as it comes (:meth:`readany`), then :meth:`release` it (or
    use ``async with``): a finished answer's connection goes back to the pool, an unfinished
    one's is closed. Only an answer read as it comes pauses its engine while its reader lags.
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
        self._whole = False  # read(): take everything, wake once at the end
        self._paused = False
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        self._resume()
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
        self._buffered = 0
        self._resume()
        return data

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._connection.resume_reading()

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
        if self._done:
            return
        self._chunks.append(data)
        if self._whole:
            return
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused:
            self._paused = True
            self._connection.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._resume()  # nothing more is coming; the connection may go back to the pool
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._wake()


_NO_BODY = frozenset({204, 304})


def _framed(headers: dict[str, str]) -> bool:
    """Whether an answer's headers say where its body ends: Content-Length (the parser checks
    its value), or chunked as the only transfer coding."""
    coding = headers.get("transfer-encoding")
    if coding is None:
        return "content-length" in headers
    return coding.lower() == "chunked"


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: HTTPResponse | None = None
        self._head: asyncio.Future[HTTPResponse] | None = None
        self._head_bytes = 0
        self._answer_by = math.inf
        self._armed_at = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.idle = False  # in the pool's idle list
        self.idle_since = 0.0
        self.answered = False  # any byte of an answer to the current request

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self.answered:
            self.answered = True
            if data[:1] != b"H":  # not even a status line: nothing of it is to be parsed
                self._abort(HTTPProtocolError(f"not an HTTP answer: {data[:16]!r}"))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abort(HTTPProtocolError(f"invalid HTTP answer: {exc}"))
            return
        head = self._head
        if head is not None and not head.done():  # all of data was head: the head goes on
            self._head_bytes += len(data)
            if self._head_bytes > _MAX_HEAD:
                self._abort(HTTPProtocolError(f"answer head over {_MAX_HEAD} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.drop(self)
        if self._response is None:
            return
        if exc is not None:
            detail = f"connection lost: {exc}"
        elif self.answered:
            detail = "the engine closed the connection before its answer ended"
        else:
            detail = "the engine closed the connection without answering"
        self._abort(HTTPDisconnectError(detail))

    # httptools callbacks

    def on_message_begin(self) -> None:
        response = self._response
        if response is None or response._done:  # an answer nobody asked for
            self._abort(HTTPProtocolError("answer without a request"))
            return
        response.status = 0  # after an interim (1xx) answer: the real one
        response.headers = {}

    def on_status(self, reason: bytes) -> None:
        if reason.translate(None, _REASON_BYTES):
            self._abort(HTTPProtocolError(f"invalid reason phrase {reason!r}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is not None and response.status == 0:  # not a chunked answer's trailer
            headers = response.headers
            headers[name.decode("latin-1").lower()] = value.strip(b" \t").decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            return
        response.status = status = self._parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the real answer follows
            if status < 100:
                self._abort(HTTPProtocolError(f"invalid status {status}"))
            return
        if status not in _NO_BODY and not _framed(response.headers):
            self._abort(HTTPProtocolError("the answer does not say where it ends"))
            return
        head = self._head
        if head is not None and not head.done():
            head.set_result(response)
            if self._armed_at < self._answer_by:  # the head was in time: the answer's runs on
                self._arm(self._answer_by)

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is not None and response.status >= 200:
            response._feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        if response is None or response.status < 200:
            return
        self._cancel_timer()
        if not self._parser.should_keep_alive():
            self.closed = True
        response._finish()

    # the client's side

    async def send(
        self,
        head: bytes,
        body: bytes,
        answer_by: float,
        head_by: float,
        on_release: Callable[[], None],
    ) -> HTTPResponse:
        assert self._transport is not None
        if self.closed:
            raise HTTPDisconnectError("the engine closed the connection before the request")
        self._response = HTTPResponse(self, on_release)
        self._head = self._loop.create_future()
        self._head_bytes = 0
        self.answered = False
        self._answer_by = answer_by
        self._arm(head_by)
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
        self._cancel_timer()
        self._response = None
        self._head = None
        if reusable and not self.closed:
            self._pool.put_back(self)
        else:
            self.close()
            self._pool.drop(self)

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def pause_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _arm(self, when: float) -> None:
        self._cancel_timer()
        self._armed_at = when
        if when != math.inf:
            self._timer = self._loop.call_at(when, self._time_out)

    def _time_out(self) -> None:
        self._timer = None
        self._abort(asyncio.TimeoutError())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _abort(self, error: BaseException) -> None:
        self._cancel_timer()
        self.closed = True
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        if self._response is not None:
            self._response._fail(error)
        if self._transport is not None:
            self._transport.close()


class _Slots:
    """At most ``limit`` in use at once; waiters are served in order, each until its deadline."""

    def __init__(self, limit: int, name: str) -> None:
        self.free = limit
        self.name = name
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        """One slot now, without waiting; False when none is free."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def acquire(self, by: float) -> None:
        """One slot by the loop time ``by``, else :class:`HTTPPoolTimeout`."""
        if self.take():
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        timer = None if by == math.inf else loop.call_at(by, self._expire, waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release()  # handed a slot just as the wait ended: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next waiter
                return
        self.free += 1

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(HTTPPoolTimeout(f"no free connection to {self.name} in time"))


class _Pool:
    """One origin's connections (the idle ones most recently used first) and its slots, taken
    before one of the client's shared slots."""

    def __init__(self, origin: _Origin, limit: int, shared: _Slots) -> None:
        self.origin = origin
        self.idle: list[_Connection] = []
        self.opened: set[_Connection] = set()
        self._slots = _Slots(limit, str(origin))
        self._shared = shared

    def take_slot(self) -> bool:
        if not self._slots.take():
            return False
        if self._shared.take():
            return True
        self._slots.release()
        return False

    async def acquire_slot(self, by: float) -> None:
        await self._slots.acquire(by)
        try:
            await self._shared.acquire(by)
        except BaseException:
            self._slots.release()
            raise

    def release(self) -> None:
        self._shared.release()
        self._slots.release()

    def take(self) -> _Connection | None:
        fresh_since = time.monotonic() - _IDLE_S
        while self.idle:
            connection = self.idle.pop()
            connection.idle = False
            if not connection.closed and connection.idle_since > fresh_since:
                return connection
            connection.close()
            self.opened.discard(connection)
        return None

    def put_back(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        connection.idle = True
        self.idle.append(connection)

    def drop(self, connection: _Connection) -> None:
        """Forget a closed connection (at once when its engine closes it while idle)."""
        self.opened.discard(connection)
        if connection.idle:
            connection.idle = False
            self.idle.remove(connection)

    def close(self) -> None:
        for connection in self.idle:
            connection.idle = False
        self.idle.clear()
        for connection in list(self.opened):
            connection.close()
        self.opened.clear()


class HTTPClient:
    """Keep-alive connections to any number of engines: at most ``max_connections`` in use in
    all and ``max_per_origin`` to any one, so that one slow engine cannot take them all."""

    def __init__(
        self,
        *,
        max_connections: int = 100,
        max_per_origin: int | None = None,
        user_agent: str = "agentkv-router",
    ) -> None:
        self._pools: dict[_Origin, _Pool] = {}
        self._shared = _Slots(max_connections, "any engine")
        self._per_origin = max_per_origin or max_connections
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
        else:  # as self.post, one coroutine less on every engine step
            response = await self.request(
                "POST", url, json, headers or {}, timeout, "application/json"
            )
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
        answer_by, head_by, pool_by = _deadlines(timeout, asyncio.get_running_loop().time())
        origin, path = _Origin.parse(url)
        head = _request_head(
            method, path, origin, headers, len(body), content_type, self._user_agent
        )
        pool = self._pool(origin)
        if not pool.take_slot():
            await pool.acquire_slot(pool_by)
        try:
            return await self._send(
                pool, head, body, timeout.connect, answer_by, head_by, idempotent=method == "GET"
            )
        except BaseException:
            pool.release()
            raise

    def _pool(self, origin: _Origin) -> _Pool:
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(origin, self._per_origin, self._shared)
        return pool

    async def _send(
        self,
        pool: _Pool,
        head: bytes,
        body: bytes,
        connect_s: float | None,
        answer_by: float,
        head_by: float,
        idempotent: bool,
    ) -> HTTPResponse:
        # A kept-alive connection may have been closed by the engine a moment ago. A GET that
        # meets one is sent again on a new connection; a POST never is (the engine may have
        # acted on it before closing).
        if (connection := pool.take()) is not None:
            try:
                return await connection.send(head, body, answer_by, head_by, pool.release)
            except HTTPDisconnectError:
                if not idempotent or connection.answered:
                    raise
        connection = await self._connect(pool, connect_s, head_by)
        return await connection.send(head, body, answer_by, head_by, pool.release)

    async def _connect(self, pool: _Pool, connect_s: float | None, by: float) -> _Connection:
        loop = asyncio.get_running_loop()
        origin = pool.origin
        bound = by - loop.time() if connect_s is None else min(connect_s, by - loop.time())
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(pool), origin.host, origin.port),
                None if bound == math.inf else bound,
            )
        except asyncio.TimeoutError:  # an OSError too, and it stays what it is
            raise
        except OSError as exc:
            raise _connect_failure(origin, exc) from exc
        if not connection.closed:
            pool.opened.add(connection)
        return connection

    async def close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _connect_failure(origin: _Origin, exc: OSError) -> HTTPError:
    """The engine's refusal (or no route to it), or the router's own lack of a socket."""
    detail = f"cannot connect to {origin}: {exc.strerror or exc}"
    if exc.errno in _LOCAL_ERRNOS:
        return HTTPLocalError(detail)
    return HTTPConnectError(detail)


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
