"""Bad input gets a 4xx in OpenAI's error format and never reaches an engine."""

from __future__ import annotations

import json

import pytest

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}


def _chat(**changes):
    return json.dumps({**CHAT, **changes}).encode()


CASES = [
    (
        "malformed json",
        "/v1/chat/completions",
        b'{"model": "m", "messages": [',
        {},
        400,
        "invalid_json",
    ),
    ("not utf-8", "/v1/chat/completions", b"\xff\xfe{}", {}, 400, "invalid_json"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_json"),
    ("nested too deep", "/v1/chat/completions", b"[" * 2000 + b"]" * 2000, {}, 400, "invalid_json"),
    # Found by test_fuzz.py's socket fuzz: read (orjson takes 1024 levels), but not written
    # again for the engine (the standard library ran out of stack), a 500 with tracebacks.
    *(
        (
            f"nested {depth} deep in a valid chat body",
            "/v1/chat/completions",
            _chat(x=None).replace(b"null", b"[" * depth + b"]" * depth),
            {},
            400,
            "invalid_json",
        )
        for depth in (129, 255, 980, 1000, 1020, 1024)
    ),
    (
        "nested too deep in a report",
        "/internal/v1/kv-holdings",
        b'{"ticket": "t", "kv_transfer_params": {"x": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
        {"x-agentkv-secret": "test-secret"},
        400,
        "invalid_json",
    ),
    ("NaN", "/v1/chat/completions", _chat(temperature=float("nan")), {}, 400, "invalid_json"),
    (
        "integer past the digit limit",
        "/v1/chat/completions",
        b'{"model": "m", "seed": ' + b"9" * 5000 + b"}",
        {},
        400,
        "invalid_json",
    ),
    (
        "missing model",
        "/v1/chat/completions",
        json.dumps({"messages": CHAT["messages"]}).encode(),
        {},
        400,
        "missing_required_parameter",
    ),
    ("empty model", "/v1/chat/completions", _chat(model=""), {}, 400, "missing_required_parameter"),
    (
        "missing messages",
        "/v1/chat/completions",
        json.dumps({"model": "m"}).encode(),
        {},
        400,
        "missing_required_parameter",
    ),
    (
        "empty messages",
        "/v1/chat/completions",
        _chat(messages=[]),
        {},
        400,
        "missing_required_parameter",
    ),
    (
        "missing prompt",
        "/v1/completions",
        json.dumps({"model": "m"}).encode(),
        {},
        400,
        "missing_required_parameter",
    ),
    ("stream not bool", "/v1/chat/completions", _chat(stream="yes"), {}, 400, "invalid_value"),
    (
        "bad session header",
        "/v1/chat/completions",
        _chat(),
        {"x-session-id": "has space"},
        400,
        "invalid_session_id",
    ),
    (
        "session id too long",
        "/v1/chat/completions",
        _chat(),
        {"x-session-id": "a" * 129},
        400,
        "invalid_session_id",
    ),
    (
        "bad session body",
        "/v1/chat/completions",
        _chat(prompt_cache_key=42),
        {},
        400,
        "invalid_session_id",
    ),
    (
        "bad turn header",
        "/v1/chat/completions",
        _chat(),
        {"x-agentkv-turn": "0"},
        400,
        "invalid_value",
    ),
    (
        "bad next turn",
        "/v1/chat/completions",
        _chat(),
        {"x-agentkv-next-turn-seconds": "nan"},
        400,
        "invalid_value",
    ),
    (
        "bad session end",
        "/v1/chat/completions",
        _chat(agentkv={"session_end": "maybe"}),
        {},
        400,
        "invalid_value",
    ),
    ("agentkv not object", "/v1/chat/completions", _chat(agentkv=[1]), {}, 400, "invalid_value"),
    # Found by test_fuzz.py: both raised inside the router (500) before they were handled.
    (
        "control character in a forwarded header",
        "/v1/chat/completions",
        _chat(),
        {"authorization": "Bearer a\x01b"},
        400,
        "invalid_value",
    ),
    (
        "non-ASCII digit as Content-Length",
        "/v1/chat/completions",
        _chat(),
        {"content-length": "²".encode("latin-1")},
        400,
        "invalid_request",
    ),
    ("oversized", "/v1/chat/completions", _chat(padding="x" * 9000), {}, 413, "request_too_large"),
    (
        "oversized report",
        "/internal/v1/kv-holdings",
        json.dumps({"ticket": "x" * 9000, "kv_transfer_params": {}}).encode(),
        {"x-agentkv-secret": "test-secret"},
        413,
        "request_too_large",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_bad_input_is_refused_before_any_engine(
    make_router, path, body, headers, status, code
):
    router = await make_router(max_body_bytes=8192)

    response = await router.client.post(
        path, content=body, headers={"content-type": "application/json", **headers}
    )

    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert router.engine_requests() == 0


async def test_oversized_body_without_content_length_is_refused(make_router):
    router = await make_router(max_body_bytes=4096)

    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    response = await router.client.post("/v1/chat/completions", content=chunks())

    assert response.status_code == 413
    assert router.engine_requests() == 0


@pytest.mark.parametrize("depth", [2, 64, 128])
async def test_bodies_nested_up_to_the_limit_are_served(make_router, depth):
    router = await make_router()
    # the deepest level holds an integer past 64 bits: written by the standard library
    nested = b"[" * (depth - 1) + str(2**70).encode() + b"]" * (depth - 1)
    body = _chat(x=None).replace(b"null", nested)

    response = await router.client.post("/v1/chat/completions", content=body)

    assert response.status_code == 200, response.text
    assert router.engine_requests() == 2


async def test_the_nesting_limit_is_a_setting(make_router):
    router = await make_router(max_json_depth=8)
    body = _chat(x=None).replace(b"null", b"[" * 8 + b"]" * 8)

    response = await router.client.post("/v1/chat/completions", content=body)

    assert response.status_code == 400
    assert "deeper than 8 levels" in response.json()["error"]["message"]


async def test_unknown_route_is_an_openai_error(make_router):
    router = await make_router()
    response = await router.client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
