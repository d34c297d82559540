"""The SDK over a real socket: a stdlib HTTP server on 127.0.0.1 in front of agentkv's FakeRouter."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from pydantic import BaseModel

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

    @classmethod
    @contextlib.contextmanager
    def serving(cls, fake: FakeRouter) -> Iterator[LoopbackRouter]:
        server = cls(fake)
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        try:
            yield server
        finally:
            server.shutdown()
            server.server_close()
            thread.join()

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
    with LoopbackRouter.serving(
        FakeRouter([Reply.tool_call("weather"), Reply("18C")] * 4)
    ) as server:
        yield server


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


class Weather(BaseModel):
    city: str
    celsius: int


def test_parse_stream_helper_and_streaming_response_over_a_socket():
    """The call paths that bypass ``create``: tagged on a real socket, each its own turn."""
    fake = FakeRouter([Reply('{"city": "Paris", "celsius": 18}')] * 4)
    with LoopbackRouter.serving(fake) as server:
        client = agentkv.OpenAI(api_key="test", base_url=server.base_url, max_retries=0)
        with agentkv.session("loop-paths") as s:
            parsed = client.chat.completions.parse(
                model="m", messages=[USER], response_format=Weather
            )
            with client.chat.completions.stream(
                model="m", messages=[USER], response_format=Weather
            ) as stream:
                streamed = stream.get_final_completion()
            with client.chat.completions.with_streaming_response.create(
                model="m", messages=[USER], stream=True
            ) as response:
                lines = [line for line in response.iter_lines() if line]
            answer = client.responses.create(model="m", input="weather?")
    assert parsed.choices[0].message.parsed == Weather(city="Paris", celsius=18)
    assert streamed.choices[0].message.parsed == Weather(city="Paris", celsius=18)
    assert lines[-1] == "data: [DONE]"
    assert answer.output_text == '{"city": "Paris", "celsius": 18}'
    wire = fake.requests
    assert [r.path for r in wire] == ["/v1/chat/completions"] * 3 + ["/v1/responses"]
    assert [r.headers["x-session-id"] for r in wire] == ["loop-paths"] * 4
    assert [r.body["agentkv"]["turn"] for r in wire] == [1, 2, 3, 4]
    assert [t.finish_reason for t in s.turns] == ["stop", "stop", "stop", "completed"]
    assert {t.kv_path for t in s.turns} == {"reuse"}


async def test_async_responses_stream_over_a_socket():
    fake = FakeRouter([Reply.tool_call("weather", {"city": "Paris"})])
    with LoopbackRouter.serving(fake) as server:
        client = agentkv.AsyncOpenAI(api_key="test", base_url=server.base_url, max_retries=0)
        async with agentkv.session("loop-responses") as s:
            stream = await client.responses.create(model="m", input="weather?", stream=True)
            events = [event.type async for event in stream]
        await client.close()
    assert events == ["response.created", "response.completed"]
    (request,) = fake.requests
    assert request.headers["x-session-id"] == "loop-responses"
    assert request.body["prompt_cache_key"] == "loop-responses"
    assert s.last_turn.finish_reason == "tool_calls" and s.last_turn.kv_path == "reuse"
