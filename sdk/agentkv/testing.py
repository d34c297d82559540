"""Test doubles for code built on agentkv (ours and yours): a fake router behind a mock transport.

    router = FakeRouter([Reply.tool_call("search", {"q": "kv"}), Reply("done")])
    client = agentkv.OpenAI(api_key="test", http_client=router.http_client())
    ...   # or, over real HTTP: with serve(router) as base_url: ...
    assert router.requests[0].headers["x-session-id"] == ...

The fake answers ``/chat/completions``, ``/completions`` and ``/responses`` with OpenAI-shaped
JSON, or server-sent events when the request asks to stream, and ``GET /models``; it reports a
KV path the way the agentkv router does (docs/protocol.md section 3) for requests that carry a
session id. Replies come from a script (``replies``) or from a ``model``: a function of the
request body, for fakes that must react to what the agent sent (tool results, tool_choice).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai

from agentkv import protocol

__all__ = ["FakeRouter", "RecordedRequest", "Reply", "openai_httpx", "serve"]

# The HTTP library the installed openai is built on: httpx for openai 2.x, its fork httpx2 for 3.x.
# Mock transports and clients handed to openai must come from that one.
openai_httpx = importlib.import_module(
    "httpx2" if int(openai.__version__.split(".")[0]) >= 3 else "httpx"
)


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted model answer: text, or a single tool call."""

    text: str = "ok"
    tool_name: str | None = None
    tool_arguments: str = "{}"
    tool_call_id: str = "call_0"

    @classmethod
    def tool_call(
        cls, name: str, arguments: dict[str, Any] | None = None, *, call_id: str = "call_0"
    ) -> Reply:
        return cls(
            text="",
            tool_name=name,
            tool_arguments=json.dumps(arguments or {}),
            tool_call_id=call_id,
        )

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_name else "stop"


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """A request as the fake received it."""

    path: str
    headers: openai_httpx.Headers
    body: dict[str, Any]

    @property
    def session_id(self) -> str | None:
        return self.headers.get(protocol.HEADER_SESSION_ID)

    @property
    def turn(self) -> int | None:
        turn = self.headers.get(protocol.HEADER_TURN)
        return None if turn is None else int(turn)

    @property
    def tool_continuation(self) -> bool:
        return self.headers.get(protocol.HEADER_TOOL_CONTINUATION) == "1"


@dataclass
class FakeRouter:
    """An OpenAI-compatible endpoint as an ``openai_httpx.MockTransport`` handler.

    Replies are served in order, then ``Reply()`` forever; with a ``model``, each reply is
    ``model(body)`` instead. A session's turns report ``kv_path`` and ``reused_tokens``; with
    ``cold_first_turn``, its first turn (``x-agentkv-turn: 1``) reports ``recompute`` and 0, as
    the router does. Thread- and task-safe.
    """

    replies: Iterable[Reply] = ()
    kv_path: str = "reuse"
    reused_tokens: int = 96
    model: Callable[[dict[str, Any]], Reply] | None = None
    cold_first_turn: bool = False
    model_name: str = "fake"
    requests: list[RecordedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._replies: Iterator[Reply] = iter(self.replies)
        self._lock = threading.Lock()

    def http_client(self) -> openai_httpx.Client:
        return openai_httpx.Client(transport=openai_httpx.MockTransport(self))

    def async_http_client(self) -> openai_httpx.AsyncClient:
        return openai_httpx.AsyncClient(transport=openai_httpx.MockTransport(self))

    def __call__(self, request: openai_httpx.Request) -> openai_httpx.Response:
        if request.method == "GET" and request.url.path.endswith("/models"):
            models = [{"id": self.model_name, "object": "model", "owned_by": "agentkv"}]
            return openai_httpx.Response(200, json={"object": "list", "data": models})
        body = json.loads(request.content or b"{}")
        with self._lock:
            self.requests.append(RecordedRequest(request.url.path, request.headers, body))
            reply = self.model(body) if self.model else next(self._replies, Reply())
        events = _events_for(request.url.path)(reply, body.get("model", self.model_name))
        headers = self._router_headers(request.headers)
        if body.get("stream"):
            sse = {**headers, "content-type": "text/event-stream"}
            return openai_httpx.Response(200, headers=sse, stream=_EventStream(events[:-1]))
        return openai_httpx.Response(200, headers=headers, json=events[-1])

    def _router_headers(self, request_headers: openai_httpx.Headers) -> dict[str, str]:
        session_id = request_headers.get(protocol.HEADER_SESSION_ID)
        if session_id is None:
            return {}
        cold = self.cold_first_turn and request_headers.get(protocol.HEADER_TURN, "1") == "1"
        return {
            protocol.HEADER_RESPONSE_SESSION_ID: session_id,
            protocol.HEADER_KV_PATH: "recompute" if cold else self.kv_path,
            protocol.HEADER_REUSED_TOKENS: "0" if cold else str(self.reused_tokens),
        }


@contextlib.contextmanager
def serve(router: FakeRouter) -> Iterator[str]:
    """Serves ``router`` over real HTTP on 127.0.0.1 (for code that builds its own clients);
    yields the ``/v1`` base URL to give them."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            content = self.rfile.read(int(self.headers.get("content-length") or 0))
            request = openai_httpx.Request(
                self.command,
                f"http://fake{self.path}",
                headers=list(self.headers.items()),
                content=content,
            )
            response = router(request)
            body = response.read()
            self.send_response(response.status_code)
            for name, value in response.headers.items():
                if name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _EventStream(openai_httpx.SyncByteStream, openai_httpx.AsyncByteStream):
    """A streamed body that yields one server-sent event at a time, to sync and async clients,
    so that clients see a stream's events arrive one by one as they would from a server."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._parts = [f"data: {json.dumps(event)}\n\n".encode() for event in events]
        self._parts.append(b"data: [DONE]\n\n")

    def __iter__(self) -> Iterator[bytes]:
        yield from self._parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            yield part


def _events_for(path: str) -> Callable[[Reply, str], list[dict[str, Any]]]:
    """The event builder for an endpoint: each returns the stream's events, then the whole body."""
    if path.endswith("/chat/completions"):
        return _chat
    if path.endswith("/completions"):
        return _completion
    return _response


def _chat(reply: Reply, model: str) -> list[dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_name:
        function = {"name": reply.tool_name, "arguments": reply.tool_arguments}
        call = {"id": reply.tool_call_id, "type": "function", "function": function}
        message["tool_calls"] = [call]
    delta = {**message}
    if reply.tool_name:
        delta["tool_calls"] = [{"index": 0, **message["tool_calls"][0]}]
    chunk = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": model}
    return [
        {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]},
        {
            "id": "chatcmpl-0",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}],
        },
    ]


def _completion(reply: Reply, model: str) -> list[dict[str, Any]]:
    done = {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": reply.text, "finish_reason": "stop", "logprobs": None}],
    }
    return [done, done]


def _response(reply: Reply, model: str) -> list[dict[str, Any]]:
    if reply.tool_name:
        item = {
            "type": "function_call",
            "id": "fc_0",
            "call_id": reply.tool_call_id,
            "name": reply.tool_name,
            "arguments": reply.tool_arguments,
            "status": "completed",
        }
    else:
        content = [{"type": "output_text", "text": reply.text, "annotations": []}]
        item = {"type": "message", "id": "msg_0", "role": "assistant", "status": "completed"}
        item["content"] = content
    response = {
        "id": "resp_0",
        "object": "response",
        "created_at": 0,
        "model": model,
        "status": "completed",
        "output": [item],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    created = {**response, "status": "in_progress", "output": []}
    return [
        {"type": "response.created", "sequence_number": 0, "response": created},
        {"type": "response.completed", "sequence_number": 1, "response": response},
        response,
    ]
