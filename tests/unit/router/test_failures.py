"""Which failures blame an engine: only what the engine did on the wire.

Engine calls go over real sockets on loopback to scripted peers; each failure must come out with
its kind, and only a refused new connection may mark an engine lost (its holdings void). The
router's own failures (no free connection in time, a bad answer it cannot use) blame nobody.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import get_args

import pytest

from agentkv_server.router.failures import LOST, SUSPECT, ErrorKind, wire_kind
from agentkv_server.router.http_client import (
    HTTPClient,
    HTTPDisconnectError,
    HTTPPoolTimeout,
    HTTPProtocolError,
    Timeout,
)
from agentkv_server.router.orchestrator.relay import _blame_broken_stream
from agentkv_server.router.placement import Engine, EnginePool, HealthMonitor, probe_health
from agentkv_server.router.upstream import EngineFailure, open_stream, post_json
from agentkv_server.router.watchdog import Watchdog
from agentkv_server.settings import FaultSettings

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = Timeout(total=5.0, connect=2.0)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

# kind -> (lost, suspect) after a step failed with it
BLAME: dict[str, tuple[bool, bool]] = {
    "connect": (True, False),
    "disconnect": (False, True),
    "timeout": (False, True),
    "hang": (False, True),
    "stall": (False, True),
    "status": (False, False),
    "protocol": (False, False),
    "stream": (False, False),
    "router": (False, False),
    "deadline": (False, False),  # the turn ran out of time on a busy engine
}


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)


def ok(body: bytes = b"{}") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body


@pytest.fixture
def peer(listen: Callable[..., Awaitable[str]]) -> Callable[[Script], Awaitable[str]]:
    """``await peer(script)``: the URL of an engine that runs ``script`` per connection."""

    async def start(script: Script) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await script(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        return await listen(serve)

    return start


@pytest.fixture
async def http() -> AsyncIterator[HTTPClient]:
    client = HTTPClient(max_connections=1)
    yield client
    await client.close()


def refused_url() -> str:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{bound.getsockname()[1]}"


async def hold_the_only_connection(peer, http: HTTPClient) -> Callable[[], None]:
    """Take ``http``'s one connection with a stream that never ends; returns its release."""

    async def streams(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n")
        await reader.read()

    response = await http.post(await peer(streams) + "/", b"{}", {}, TIMEOUT)
    return response.release


def test_every_kind_has_its_blame() -> None:
    assert set(BLAME) == set(get_args(ErrorKind))


@pytest.mark.parametrize("kind", sorted(BLAME))
def test_only_a_refused_connection_loses_an_engine(kind: ErrorKind) -> None:
    engine = Engine("http://engine", "decode")

    engine.record_failure(kind)

    lost, suspect = BLAME[kind]
    assert (engine.lost_at > 0) is lost
    assert engine.healthy is not (lost or suspect)


def test_the_docs_name_each_failure_that_blames_an_engine() -> None:
    text = (ROOT / "docs" / "router.md").read_text()
    match = re.search(r"\n### Which failures blame an engine\n(.*?)\n#", text, re.DOTALL)
    assert match, "docs/router.md lacks its section 'Which failures blame an engine'"
    for kind in LOST | SUSPECT:
        assert f"`{kind}`" in match.group(1), kind


async def test_a_kept_alive_connection_dropped_before_the_answer_is_a_disconnect(
    peer, http
) -> None:
    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok())
        await read_request(reader)  # the second request: hang up

    engine = Engine(await peer(answer_once), "decode")
    await post_json(http, engine, "/v1/x", {}, {}, TIMEOUT)

    with pytest.raises(EngineFailure) as caught:
        await post_json(http, engine, "/v1/x", {}, {}, TIMEOUT)
    engine.record_failure(caught.value.kind)

    assert caught.value.kind == "disconnect"
    assert engine.lost_at == 0.0 and not engine.healthy


async def test_a_refused_connection_is_the_one_failure_that_loses_an_engine(http) -> None:
    engine = Engine(refused_url(), "decode")

    with pytest.raises(EngineFailure) as caught:
        await post_json(http, engine, "/v1/x", {}, {}, TIMEOUT)
    engine.record_failure(caught.value.kind)

    assert caught.value.kind == "connect"
    assert engine.lost_at > 0


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n{x}", b"HTTP/1.1 200 OK\r\n\r\nno framing"],
    ids=["not-json", "not-framed"],
)
async def test_an_answer_the_router_cannot_use_blames_nobody(peer, http, answer) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await reader.read()

    engine = Engine(await peer(script), "decode")

    with pytest.raises(EngineFailure) as caught:
        await post_json(http, engine, "/v1/x", {}, {}, TIMEOUT)
    engine.record_failure(caught.value.kind)

    assert caught.value.kind == "protocol"
    assert engine.healthy and engine.lost_at == 0.0


async def test_no_free_connection_in_time_is_the_routers_failure(peer, http) -> None:
    release = await hold_the_only_connection(peer, http)
    engine = Engine(await peer(lambda r, w: r.read()), "decode")
    try:
        with pytest.raises(EngineFailure) as caught:
            await post_json(http, engine, "/v1/x", {}, {}, Timeout(total=0.2))
        engine.record_failure(caught.value.kind)
    finally:
        release()

    assert caught.value.kind == "router"
    assert engine.healthy and engine.lost_at == 0.0


async def test_a_stream_waiting_for_a_connection_past_its_first_chunk_is_the_routers(
    peer, http
) -> None:
    """The first-chunk bound covers the wait for a connection, and runs out there: the
    router's failure, not a timeout of the engine."""
    release = await hold_the_only_connection(peer, http)
    engine = Engine(await peer(lambda r, w: r.read()), "decode")
    try:
        with pytest.raises(EngineFailure) as caught:
            await open_stream(
                http,
                engine,
                "/v1/x",
                {},
                {},
                timeout=Timeout(total=60.0, pool=30.0),
                first_chunk_s=0.2,
                idle_s=1.0,
            )
    finally:
        release()

    assert caught.value.kind == "router"


async def test_a_probe_the_router_could_not_make_changes_no_health(peer, http) -> None:
    release = await hold_the_only_connection(peer, http)
    pool = EnginePool("decode", [await peer(lambda r, w: r.read())])
    (engine,) = pool.engines
    monitor = HealthMonitor([pool], http, interval_s=60.0, timeout_s=0.1, failures_to_down=1)
    try:
        assert await probe_health(http, engine, Timeout(total=0.1)) == "router"
        await monitor.check_all()
    finally:
        release()

    assert engine.healthy and engine.failed_probes == 0 and engine.lost_at == 0.0


async def test_a_refused_probe_loses_the_engine_and_a_dropped_one_does_not(peer, http) -> None:
    refused = Engine(refused_url(), "decode")
    dropped = Engine(await peer(lambda r, w: read_request(r)), "decode")  # reads it, hangs up

    assert await probe_health(http, refused, TIMEOUT) == "connect"
    assert await probe_health(http, dropped, TIMEOUT) == "disconnect"

    assert refused.lost_at > 0
    assert dropped.lost_at == 0.0


async def test_progress_reads_the_router_could_not_make_are_no_hang(monkeypatch) -> None:
    engine = Engine("http://engine", "decode")
    reads, step = 0, asyncio.get_running_loop().create_future()

    async def no_free_connection(*args: object, **kwargs: object) -> None:
        nonlocal reads
        reads += 1
        if reads == 4:  # two more than it takes to call a step hung
            step.set_result("done")
        raise HTTPPoolTimeout("no free connection")

    http = HTTPClient()
    monkeypatch.setattr(http, "fetch", no_free_connection)
    watchdog = Watchdog(
        http, FaultSettings(progress_every_s=0.02, unanswered_probes=2), probe_timeout_s=1.0
    )

    assert await asyncio.wait_for(watchdog.run(engine, step), 5.0) == "done"


def quiet_watchdog(monkeypatch: pytest.MonkeyPatch, **faults: float) -> tuple[Watchdog, list[str]]:
    """A watchdog whose engine never answers a progress read or health probe (the URLs it
    asked are listed)."""
    asked: list[str] = []

    async def no_answer(url: str, timeout: Timeout, *args: object, **kwargs: object) -> None:
        asked.append(url)
        await asyncio.sleep(timeout.total or 0.0)
        raise asyncio.TimeoutError

    http = HTTPClient()
    monkeypatch.setattr(http, "fetch", no_answer)
    settings = FaultSettings(**{"progress_every_s": 0.02, "unanswered_probes": 2} | faults)
    return Watchdog(http, settings, probe_timeout_s=0.02), asked


async def test_a_quick_step_on_an_engine_heard_from_lately_asks_nothing(monkeypatch) -> None:
    """Most steps: no watcher task, no read, and the engine counts as heard from again."""
    watchdog, asked = quiet_watchdog(monkeypatch)
    engine = Engine("http://engine", "decode")
    engine.mark_answered()
    tasks = len(asyncio.all_tasks())

    async def step() -> str:
        assert len(asyncio.all_tasks()) == tasks  # the step runs in the caller's task
        await asyncio.sleep(0)
        return "done"

    assert await watchdog.run(engine, step()) == "done"
    await asyncio.sleep(0.05)  # past progress_every_s: the step's watcher never starts
    assert asked == []


async def test_a_step_that_hangs_is_aborted_and_the_caller_goes_on(monkeypatch) -> None:
    """The watcher starts once the step has run progress_every_s, finds the hang and cancels
    the step; the caller gets the hang, not a cancel, and is not left cancelling."""
    watchdog, asked = quiet_watchdog(monkeypatch)
    engine = Engine("http://engine", "decode")
    engine.mark_answered()
    step_cancelled = asyncio.Event()

    async def frozen_step() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            step_cancelled.set()
            raise

    with pytest.raises(EngineFailure) as failure:
        await asyncio.wait_for(watchdog.run(engine, frozen_step()), 5.0)

    assert failure.value.kind == "hang" and step_cancelled.is_set()
    assert asked and all(url.endswith("/metrics") for url in asked)
    current = asyncio.current_task()
    assert current is not None and getattr(current, "cancelling", lambda: 0)() == 0
    await asyncio.sleep(0)  # the caller can still await


async def test_a_step_on_an_engine_not_heard_from_is_probed_as_it_starts(monkeypatch) -> None:
    watchdog, asked = quiet_watchdog(monkeypatch, progress_every_s=30.0, liveness_timeout_s=0.02)
    engine = Engine("http://engine", "decode")  # never answered

    with pytest.raises(EngineFailure) as failure:
        await asyncio.wait_for(watchdog.run(engine, asyncio.sleep(3600)), 5.0)

    assert failure.value.kind == "hang"
    assert asked == ["http://engine/health"] * 2


async def test_a_watched_step_cancelled_from_outside_is_cancelled(monkeypatch) -> None:
    watchdog, _ = quiet_watchdog(monkeypatch, progress_every_s=0.01, stall_s=60.0)
    engine = Engine("http://engine", "decode")
    engine.mark_answered()
    call = asyncio.ensure_future(watchdog.run(engine, asyncio.sleep(3600)))
    await asyncio.sleep(0.03)  # its watcher is reading progress

    call.cancel()

    with pytest.raises(asyncio.CancelledError):
        await call


@pytest.mark.parametrize(
    "error, suspect",
    [
        (None, True),  # ended before its end
        (HTTPDisconnectError("dropped"), True),
        (asyncio.TimeoutError(), True),  # no chunk for stall_s
        (HTTPProtocolError("garbage"), False),
        (HTTPPoolTimeout("no slot"), False),
    ],
    ids=["ended-early", "dropped", "quiet", "garbage", "router"],
)
def test_a_broken_stream_blames_its_engine_only_for_what_it_did(error, suspect) -> None:
    engine = Engine("http://engine", "decode")

    _blame_broken_stream(engine, error)

    assert engine.healthy is not suspect
    assert engine.lost_at == 0.0
    if error is not None:
        assert wire_kind(error) in SUSPECT or not suspect
