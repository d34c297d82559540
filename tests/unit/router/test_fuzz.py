"""Fuzzing the router's HTTP API with Hypothesis, in front of stub engines: in process, and as
uvicorn serves it on a loopback socket (:func:`test_hostile_bodies_over_a_socket`).

Whatever a client sends (any JSON, any bytes, any content type, any headers, any session id,
any credentials), the router answers: never a 5xx, never an exception out of the app
(``httpx.ASGITransport`` re-raises one), every 4xx in OpenAI's error format, no request left
counted in flight on an engine. One router serves all of a test's examples, so whatever state
one input leaves behind meets the next, and afterwards it must still serve a valid turn.
"""

from __future__ import annotations

import contextlib
import json
import string
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentkv import protocol
from agentkv_server.testing import InProcessRouter, conversation, serve_on_loopback

FUZZ = settings(
    max_examples=150,
    deadline=None,  # a shared, loaded CI machine: no per-example time limit
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
API_KEY = "fuzz-tenant-key-0123456789"
VALID_KEYS = (f"Bearer {API_KEY}", f"bearer   {API_KEY}", f"BEARER {API_KEY}")
PATHS = ("/v1/chat/completions", "/v1/completions")
HEADER_NAMES = (
    "x-session-id",
    "x-dynamo-session-id",
    "x-litellm-session-id",
    "x-agentkv-turn",
    "x-agentkv-tool-continuation",
    "x-agentkv-next-turn-seconds",
    "x-agentkv-session-end",
    "x-agentkv-version",
    "x-agentkv-secret",
    "authorization",
    "content-type",
    "content-length",
    "transfer-encoding",
)
INJECTED = "fuzz-injected"  # a client's kv_transfer_params must never reach an engine

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()  # NaN and infinities included: not JSON, must be refused
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
# Header values as a client library would send them: latin-1 without line breaks (as bytes,
# since httpx encodes str values as ASCII).
header_values = st.text(
    st.characters(codec="latin-1", exclude_characters="\r\n\x00"), max_size=40
).map(lambda value: value.strip().encode("latin-1"))
header_names = st.sampled_from(HEADER_NAMES) | st.text(
    string.ascii_lowercase + string.digits + "-", min_size=1, max_size=12
)
headers = st.dictionaries(header_names, header_values, max_size=6)
session_ids = st.from_regex(protocol.SESSION_ID_PATTERN, fullmatch=True) | st.text(max_size=140)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
        optional={"content": st.text(max_size=30)},
    ),
    min_size=1,
    max_size=4,
)
# Per body field, values a client might plausibly send, valid or not; ``json_values`` bodies
# cover junk. Many of these requests get through to the engines.
PLAUSIBLE = {
    "model": st.sampled_from(["stub-model", "another-model"]),
    "messages": messages,
    "prompt": st.text(max_size=30) | st.lists(st.integers(0, 50_000), max_size=8),
    "stream": st.booleans(),
    "max_tokens": st.integers(-1, 5000),
    "max_completion_tokens": st.integers(-1, 5000),
    "prompt_cache_key": session_ids,
    "conversation_id": session_ids,
    "agentkv": st.fixed_dictionaries(
        {},
        optional={
            "session_id": session_ids,
            "turn": st.integers(-1, 10),
            "tool_continuation": st.booleans(),
            "next_turn_seconds": st.floats(-1, 1e6),
            "session_end": st.booleans(),
            "version": st.text(max_size=10),
        },
    ),
    "kv_transfer_params": st.fixed_dictionaries(
        {"remote_engine_id": st.just(INJECTED)},
        optional={"agentkv_release": st.just([INJECTED]), "do_remote_decode": st.booleans()},
    ),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "min_tokens": st.integers(0, 10),
    "n": st.integers(0, 3),
    "temperature": st.floats(0, 2),
    "tools": st.lists(json_values, max_size=2),
}
changes = st.lists(
    st.sampled_from(sorted(PLAUSIBLE)).flatmap(
        lambda field: st.tuples(st.just(field), PLAUSIBLE[field])
    ),
    max_size=4,
)
near_valid_bodies = changes.map(
    lambda pairs: (
        {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]} | dict(pairs)
    )
)


def encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


def check(router: InProcessRouter, response) -> None:
    """The router's contract for any input."""
    event(f"HTTP {response.status_code}")  # --hypothesis-show-statistics shows the mix
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        assert isinstance(error["message"], str)
    engines = [*router.state.prefill.engines, *router.state.decode.engines]
    assert all(engine.inflight == 0 for engine in engines)
    sent = [r.kv_params for e in router.cluster.engines for r in e.requests]
    assert not any(INJECTED in json.dumps(params) for params in sent)


@pytest.fixture
async def router(make_router) -> AsyncIterator[InProcessRouter]:
    """One router for all of a test's examples; afterwards it must still serve a turn."""
    router = await make_router(max_body_bytes=64 * 1024, max_header_count=20)
    yield router
    assert (await router.chat(conversation(1, 20), session="after")).status_code == 200


@pytest.fixture
async def keyed_router(make_router) -> AsyncIterator[InProcessRouter]:
    router = await make_router(api_keys=[API_KEY])
    yield router
    response = await router.chat(conversation(1, 20), headers={"authorization": VALID_KEYS[0]})
    assert response.status_code == 200


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    body=json_values | near_valid_bodies,
    extra=st.just({}) | headers,
)
async def test_any_json_body(router: InProcessRouter, path: str, body: Any, extra) -> None:
    check(router, await router.client.post(path, content=encode(body), headers=extra))


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    content=st.binary(max_size=200),
    content_type=st.sampled_from([b"application/json", b"text/plain", b"", b"multipart/form-data"])
    | header_values,
)
async def test_any_bytes_and_content_type(
    router: InProcessRouter, path: str, content: bytes, content_type: bytes
) -> None:
    response = await router.client.post(
        path, content=content, headers={"content-type": content_type}
    )
    check(router, response)


@FUZZ
@given(body=near_valid_bodies, extra=headers, session=session_ids, in_body=st.booleans())
async def test_any_headers_and_session_ids(
    router: InProcessRouter, body: dict[str, Any], extra, session: str, in_body: bool
) -> None:
    if in_body:
        body = {**body, "prompt_cache_key": session}
    else:
        extra = {**extra, "x-session-id": session.encode("utf-8")}
    turn = await router.client.post("/v1/chat/completions", content=encode(body), headers=extra)
    check(router, turn)
    end = await router.client.delete("/v1/sessions/" + quote(session, safe=""), headers=extra)
    check(router, end)


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=st.sampled_from(
        ["/v1/models", "/health", "/metrics", "/internal/v1/kv-holdings", "/v1/sessions/x"]
    )
    | st.text(string.printable, max_size=30).map(lambda p: "/" + quote(p)),
    body=json_values,
    extra=headers,
)
async def test_any_route_and_method(
    router: InProcessRouter, method: str, path: str, body: Any, extra
) -> None:
    response = await router.client.request(method, path, content=encode(body), headers=extra)
    check(router, response)


@FUZZ
@given(
    authorization=st.sampled_from(VALID_KEYS).map(str.encode) | header_values,
    body=near_valid_bodies,
    session=session_ids,
)
async def test_any_credentials(
    keyed_router: InProcessRouter, authorization: bytes, body: dict[str, Any], session: str
) -> None:
    headers = {"authorization": authorization, "x-session-id": session.encode("utf-8")}
    response = await keyed_router.client.post(
        "/v1/chat/completions", content=encode(body), headers=headers
    )
    check(keyed_router, response)
    assert (response.status_code == 401) == (authorization.decode("latin-1") not in VALID_KEYS)


# Hostile bodies as bytes on the wire: valid chat turns carrying a value nested up to past the
# readers' limit (1024 levels), odd Unicode (lone surrogates escaped, or raw as invalid UTF-8),
# bytes that are not UTF-8, junk of any type in any field, and bodies past the size limit.
depths = st.integers(1, 1100) | st.integers(940, 1040)  # 2nd: where reading and writing differ
nested = st.builds(
    lambda depth, brackets: brackets[0] * depth + b"0" + brackets[1] * depth,
    depths,
    st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]),
)
odd_text = st.text(st.characters(categories=["Cs", "Co", "Cn", "So", "Zs", "Cc"]), max_size=30)
CHAT_HEAD = b'{"model":"stub-model","max_tokens":2,"messages":[{"role":"user","content":'
hostile_bodies = st.one_of(
    nested.map(lambda value: CHAT_HEAD + b'"x"}],"x":' + value + b"}"),
    nested.map(lambda value: CHAT_HEAD + value + b"}]}"),
    odd_text.map(lambda text: CHAT_HEAD + json.dumps(text).encode() + b"}]}"),
    odd_text.map(lambda text: CHAT_HEAD + b'"' + text.encode("utf-8", "surrogatepass") + b'"}]}'),
    st.binary(max_size=64).map(lambda junk: CHAT_HEAD + b'"' + junk + b'"}]}'),
    near_valid_bodies.map(encode),
    json_values.map(encode),
    st.integers(60_000, 70_000).map(lambda n: CHAT_HEAD + b'"' + b"x" * n + b'"}]}'),
)


@contextlib.contextmanager
def python_default_recursion_limit() -> Iterator[None]:
    """Python's default recursion limit, which a served router runs under: Hypothesis raises
    it while an example runs, which hid the nesting bug below from this test."""
    raised = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        yield
    finally:
        sys.setrecursionlimit(raised)


class Served:
    """``router`` served by uvicorn on a loopback port, and a client of it; short to print in
    a falsifying example (the router's own repr nests deeper than the recursion limit)."""

    def __init__(self, router: InProcessRouter, client: httpx.AsyncClient) -> None:
        self.router = router
        self.client = client

    def __repr__(self) -> str:
        return f"Served({self.client.base_url})"


@pytest.fixture
async def served(router: InProcessRouter) -> AsyncIterator[Served]:
    async with serve_on_loopback(router.app) as url, httpx.AsyncClient(base_url=url) as client:
        yield Served(router, client)


@FUZZ
@given(path=st.sampled_from(PATHS), body=hostile_bodies)
async def test_hostile_bodies_over_a_socket(
    served: Served, errors_logged: list[str], path: str, body: bytes
) -> None:
    """The real server (uvicorn, the app's middlewares, the engines' HTTP client) under
    hostile bodies: never a 5xx, always an OpenAI-shaped error, nothing logged as an ERROR.

    It finds issue 50's nesting bug in the code before its fix: a valid chat body carrying a
    value nested about 950-1024 deep was read (orjson reads 1024 levels) but could not be
    written again for the engine (orjson writes 254, the standard library ran out of stack),
    and the router answered 500 and logged two tracebacks."""
    errors_logged.clear()  # one list for all examples
    with python_default_recursion_limit():
        response = await served.client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
    check(served.router, response)
    assert not errors_logged
