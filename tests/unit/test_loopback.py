"""The SDK over a real socket: a stdlib HTTP server on 127.0.0.1 in front of agentkv's FakeRouter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

import agentkv
from agentkv.testing import FakeRouter, Reply, openai_httpx

GATE_TIMEOUT_S = 10  # only a safety net: a buffering client would make the server wait this long


class LoopbackRouter(ThreadingHTTPServer):
    """Serves FakeRouter's answers over HTTP; streams hold their tail until ``release`` is set."""

    daemon_threads = True

    def __init__(self, fake: FakeRouter) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fake = fake
        self.release = threading.Event()
        self.release.set()
        self.tail_sent = threading.Event()

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: LoopbackRouter

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = openai_httpx.Request(
            "POST", f"http://loopback{self.path}", headers=list(self.headers.items()), content=body
        )
        response = self.server.fake(request)
        response.read()
        self.send_response(response.status_code)
        for name, value in response.headers.items():
            if name != "content-length":
                self.send_header(name, value)
        self.end_headers()
        self.close_connection = True  # the body ends when the connection does
        head, _, tail = response.content.partition(b"\n\n")
        self.wfile.write(head + b"\n\n")
        self.wfile.flush()
        self.server.release.wait(GATE_TIMEOUT_S)
        self.server.tail_sent.set()
        self.wfile.write(tail)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def loopback() -> Iterator[LoopbackRouter]:
    server = LoopbackRouter(FakeRouter([Reply.tool_call("weather"), Reply("18C")] * 4))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


USER = {"role": "user", "content": "weather?"}
TOOL = {"role": "tool", "tool_call_id": "call_0", "content": "18C"}


def test_sync_calls_and_stream_over_a_socket(loopback):
    client = agentkv.OpenAI(api_key="test", base_url=loopback.base_url, max_retries=0)
    with agentkv.session("loop-sync") as s:
        first = client.chat.completions.create(model="m", messages=[USER])
        stream = client.chat.completions.create(model="m", messages=[USER, TOOL], stream=True)
        assert isinstance(stream, openai.Stream)
        chunks = list(stream)
    assert first.choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices[0].finish_reason == "stop"
    wire = loopback.fake.requests
    assert [r.headers["x-session-id"] for r in wire] == ["loop-sync"] * 2
    assert [r.headers["x-agentkv-turn"] for r in wire] == ["1", "2"]
    assert wire[1].headers["x-agentkv-tool-continuation"] == "1"
    assert "x-agentkv-next-turn-seconds" in wire[1].headers
    assert [(t.kv_path, t.reused_tokens) for t in s.turns] == [("reuse", 96)] * 2


async def test_async_stream_over_a_socket(loopback):
    client = agentkv.AsyncOpenAI(api_key="test", base_url=loopback.base_url, max_retries=0)
    async with agentkv.session("loop-async") as s:
        stream = await client.chat.completions.create(model="m", messages=[USER], stream=True)
        assert [chunk async for chunk in stream][-1].choices[0].finish_reason == "tool_calls"
    assert loopback.fake.requests[0].body["agentkv"]["session_id"] == "loop-async"
    assert s.last_turn.finish_reason == "tool_calls"
    await client.close()


def test_first_chunk_arrives_before_the_server_sends_the_rest(loopback):
    loopback.release.clear()
    client = agentkv.OpenAI(api_key="test", base_url=loopback.base_url, max_retries=0)
    with agentkv.session():
        stream = client.chat.completions.create(model="m", messages=[USER], stream=True)
        first = next(stream)
        assert not loopback.tail_sent.is_set()
        loopback.release.set()
        rest = list(stream)
    assert first.choices[0].delta.tool_calls[0].function.name == "weather"
    assert rest[-1].choices[0].finish_reason == "tool_calls"
