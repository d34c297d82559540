"""Adapter tests run real framework objects against a fake OpenAI-compatible endpoint.

The fake answers like a model that calls a tool ``tool_rounds`` times after each user message and
then replies in text (at once when ``tool_choice`` is ``none``, never when it is ``required`` or
names a function; with a JSON schema response format, a sample of the schema), in JSON or as an
SSE stream, and records what reached the wire. Requests with
a session id get the router's answer headers. Tests reach it in-process through
``httpx.MockTransport`` (``http_client`` fixtures) or over loopback (``loopback_url``), which is
how the examples, run as subprocesses, see it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from agentkv import protocol

MODEL = "agentkv-fake"
_SAMPLE_BY_TYPE = {"integer": 2, "number": 2.5, "string": "paris", "boolean": True}


@dataclass(frozen=True)
class Recorded:
    """One chat request as it reached the server."""

    headers: httpx.Headers
    body: dict[str, Any]

    @property
    def session_id(self) -> str | None:
        return self.headers.get(protocol.HEADER_SESSION_ID)

    @property
    def turn(self) -> int:
        return int(self.headers[protocol.HEADER_TURN])

    @property
    def tool_continuation(self) -> bool:
        return self.headers[protocol.HEADER_TOOL_CONTINUATION] == "1"

    @property
    def last_role(self) -> str:
        return self.body["messages"][-1]["role"]


@dataclass
class FakeOpenAI:
    tool_rounds: int = 2
    requests: list[Recorded] = field(default_factory=list)

    @staticmethod
    def check_tool_loop(
        requests: list[Recorded], *, session_id: str | None = None, first_turn: int = 1
    ) -> str:
        """Checks a tool loop on the wire: one session, consecutive turns, tool results flagged.

        Returns the session id.
        """
        assert len(requests) >= 3
        ids = {request.session_id for request in requests}
        assert len(ids) == 1 and None not in ids, ids
        (found,) = ids
        if session_id is not None:
            assert found == session_id
        assert [r.turn for r in requests] == list(range(first_turn, first_turn + len(requests)))
        assert [r.tool_continuation for r in requests] == [r.last_role == "tool" for r in requests]
        assert [r.tool_continuation for r in requests][1:] == [True] * (len(requests) - 1)
        assert all(r.body["prompt_cache_key"] == found for r in requests)
        assert all(r.body["agentkv"]["turn"] == r.turn for r in requests)
        return found

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        body = json.loads(request.content)
        self.requests.append(Recorded(request.headers, body))
        message = self._reply(body)
        headers = self._router_headers(request.headers)
        if body.get("stream"):
            return httpx.Response(
                200, content=_sse(message), headers={**headers, "content-type": "text/event-stream"}
            )
        return httpx.Response(200, json=_completion(message), headers=headers)

    def _reply(self, body: dict[str, Any]) -> dict[str, Any]:
        response_format = body.get("response_format") or {}
        if response_format.get("type") == "json_schema":
            sample = _arguments(response_format["json_schema"]["schema"])
            return {"role": "assistant", "content": json.dumps(sample)}
        tools = body.get("tools") or []
        choice = body.get("tool_choice")
        rounds = _tool_results_since_user(body["messages"])
        if (
            not tools
            or choice == "none"
            or (rounds >= self.tool_rounds and choice in (None, "auto"))
        ):
            return {"role": "assistant", "content": f"done after {rounds} tool results"}
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        tool = next(t["function"] for t in tools if name in (None, t["function"]["name"]))
        arguments = json.dumps(_arguments(tool.get("parameters") or {}))
        call = {
            "id": f"call_{len(self.requests)}",
            "type": "function",
            "function": {"name": tool["name"], "arguments": arguments},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    def _router_headers(self, headers: httpx.Headers) -> dict[str, str]:
        session_id = headers.get(protocol.HEADER_SESSION_ID)
        if session_id is None:
            return {}
        reuse = headers.get(protocol.HEADER_TURN, "1") != "1"
        return {
            protocol.HEADER_RESPONSE_SESSION_ID: session_id,
            protocol.HEADER_KV_PATH: "reuse" if reuse else "recompute",
            protocol.HEADER_REUSED_TOKENS: "96" if reuse else "0",
        }


def _tool_results_since_user(messages: list[dict[str, Any]]) -> int:
    roles = [message["role"] for message in messages]
    last_user = len(roles) - 1 - roles[::-1].index("user") if "user" in roles else -1
    return roles[last_user + 1 :].count("tool")


def _arguments(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties") or {}
    return {
        name: _SAMPLE_BY_TYPE.get(properties[name].get("type"), "x")
        for name in schema.get("required", properties)
        if name in properties
    }


def _finish_reason(message: dict[str, Any]) -> str:
    return "tool_calls" if message.get("tool_calls") else "stop"


def _completion(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(message)}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def _sse(message: dict[str, Any]) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    chunks = [
        {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": _finish_reason(message)}]},
    ]
    lines = [
        "data: "
        + json.dumps(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                **chunk,
            }
        )
        for chunk in chunks
    ]
    return ("\n\n".join([*lines, "data: [DONE]"]) + "\n\n").encode()


@contextmanager
def _serve(server: FakeOpenAI) -> Iterator[str]:
    """Serves ``server`` on a loopback port; yields its ``/v1`` base URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            request = httpx.Request(
                self.command,
                f"http://fake{self.path}",
                headers=dict(self.headers.items()),
                content=self.rfile.read(length),
            )
            response = server.handle(request)
            self.send_response(response.status_code)
            for name, value in response.headers.items():
                if name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("content-length", str(len(response.content)))
            self.end_headers()
            self.wfile.write(response.content)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server() -> FakeOpenAI:
    return FakeOpenAI(tool_rounds=2)


@pytest.fixture
def http_client(server: FakeOpenAI) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(server.handle))


@pytest.fixture
def async_http_client(server: FakeOpenAI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(server.handle))


@pytest.fixture
def loopback_url(server: FakeOpenAI) -> Iterator[str]:
    with _serve(server) as base_url:
        yield base_url
