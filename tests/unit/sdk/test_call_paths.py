"""Every public openai call path that makes a model request is tagged and leaves a TurnInfo.

agentkv tags at the HTTP client, so each path is checked on the wire (through FakeRouter behind a
MockTransport): the session id and turn in headers and body, and the router's KV path and the
finish reason in the session's last turn.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel

import agentkv
from agentkv.testing import FakeRouter, Reply, openai_httpx

USER = {"role": "user", "content": "weather in Paris?"}
CITY_JSON = '{"city": "Paris", "celsius": 18}'


class City(BaseModel):
    city: str
    celsius: int


def chat(**kwargs):
    return {"model": "m", "messages": [USER], **kwargs}


def responses(**kwargs):
    return {"model": "m", "input": "weather in Paris?", **kwargs}


def _streaming_parse(response):
    with response as opened:
        return opened.parse()


def _drain_streaming_lines(response):
    with response as opened:
        return list(opened.iter_lines())


# name -> (call, endpoint, finish reason the session records)
SYNC_PATHS = {
    "chat.completions.create": (
        lambda c: c.chat.completions.create(**chat()),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.create stream": (
        lambda c: list(c.chat.completions.create(**chat(stream=True))),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.parse": (
        lambda c: c.chat.completions.parse(**chat(response_format=City)).choices[0].message.parsed,
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.stream helper": (
        lambda c: _final_chat(c.chat.completions.stream(**chat(response_format=City))),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.with_raw_response.create": (
        lambda c: c.chat.completions.with_raw_response.create(**chat()).parse(),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.with_streaming_response.create": (
        lambda c: _streaming_parse(c.chat.completions.with_streaming_response.create(**chat())),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.with_streaming_response.create stream": (
        lambda c: _drain_streaming_lines(
            c.chat.completions.with_streaming_response.create(**chat(stream=True))
        ),
        "/v1/chat/completions",
        "stop",
    ),
    "completions.create": (
        lambda c: c.completions.create(model="m", prompt="hi"),
        "/v1/completions",
        "stop",
    ),
    "responses.create": (
        lambda c: c.responses.create(**responses()),
        "/v1/responses",
        "completed",
    ),
    "responses.create stream": (
        lambda c: list(c.responses.create(**responses(stream=True))),
        "/v1/responses",
        "completed",
    ),
    "responses.parse": (
        lambda c: c.responses.parse(**responses(text_format=City)).output_parsed,
        "/v1/responses",
        "completed",
    ),
    "responses.stream helper": (
        lambda c: _final_response(c.responses.stream(**responses(text_format=City))),
        "/v1/responses",
        "completed",
    ),
    "responses.with_raw_response.create": (
        lambda c: c.responses.with_raw_response.create(**responses()).parse(),
        "/v1/responses",
        "completed",
    ),
}


def _final_chat(manager):
    with manager as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def _final_response(manager):
    with manager as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


def assert_tagged(router: FakeRouter, session: agentkv.Session, path: str, finish: str) -> None:
    (request,) = router.requests
    assert request.path == path
    assert request.headers["x-session-id"] == session.id
    assert request.headers["x-agentkv-turn"] == "1"
    assert request.body["agentkv"]["session_id"] == session.id
    assert request.body["prompt_cache_key"] == session.id
    assert session.last_turn is not None
    assert (session.last_turn.kv_path, session.last_turn.reused_tokens) == ("reuse", 96)
    assert session.last_turn.finish_reason == finish
    assert session.last_turn.ttft_seconds is not None


@pytest.mark.parametrize("name", SYNC_PATHS)
def test_sync_call_path_is_tagged(name: str) -> None:
    call, path, finish = SYNC_PATHS[name]
    router = FakeRouter([Reply(CITY_JSON)])
    client = agentkv.OpenAI(api_key="test", http_client=router.http_client())
    with agentkv.session(f"path-{len(name)}") as session:
        call(client)
    assert_tagged(router, session, path, finish)


async def _adrain(stream):
    return [item async for item in stream]


async def _afinal_chat(manager):
    async with manager as stream:
        async for _ in stream:
            pass
        return await stream.get_final_completion()


async def _afinal_response(manager):
    async with manager as stream:
        async for _ in stream:
            pass
        return await stream.get_final_response()


async def _astreaming_parse(response):
    async with response as opened:
        return await opened.parse()


ASYNC_PATHS = {
    "chat.completions.create stream": (
        lambda c: _adrain_awaited(c.chat.completions.create(**chat(stream=True))),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.parse": (
        lambda c: c.chat.completions.parse(**chat(response_format=City)),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.stream helper": (
        lambda c: _afinal_chat(c.chat.completions.stream(**chat(response_format=City))),
        "/v1/chat/completions",
        "stop",
    ),
    "chat.completions.with_streaming_response.create": (
        lambda c: _astreaming_parse(c.chat.completions.with_streaming_response.create(**chat())),
        "/v1/chat/completions",
        "stop",
    ),
    "completions.create": (
        lambda c: c.completions.create(model="m", prompt="hi"),
        "/v1/completions",
        "stop",
    ),
    "responses.create stream": (
        lambda c: _adrain_awaited(c.responses.create(**responses(stream=True))),
        "/v1/responses",
        "completed",
    ),
    "responses.parse": (
        lambda c: c.responses.parse(**responses(text_format=City)),
        "/v1/responses",
        "completed",
    ),
    "responses.stream helper": (
        lambda c: _afinal_response(c.responses.stream(**responses(text_format=City))),
        "/v1/responses",
        "completed",
    ),
}


async def _adrain_awaited(pending):
    return await _adrain(await pending)


@pytest.mark.parametrize("name", ASYNC_PATHS)
async def test_async_call_path_is_tagged(name: str) -> None:
    call, path, finish = ASYNC_PATHS[name]
    router = FakeRouter([Reply(CITY_JSON)])
    client = agentkv.AsyncOpenAI(api_key="test", http_client=router.async_http_client())
    async with agentkv.session(f"apath-{len(name)}") as session:
        await call(client)
    assert_tagged(router, session, path, finish)


def test_requests_that_are_no_model_call_are_not_tagged() -> None:
    router = FakeRouter()
    client = agentkv.OpenAI(api_key="test", http_client=router.http_client())
    with agentkv.session() as session:
        client.post("/responses/input_tokens", cast_to=object, body={"model": "m", "input": "x"})
    (request,) = router.requests
    assert "x-session-id" not in request.headers and "agentkv" not in request.body
    assert session.turn == 0


def test_a_retried_attempt_keeps_its_turn() -> None:
    """openai retries a failed attempt: the retry is the same call, not a new turn."""
    router = FakeRouter()
    attempts = []

    def flaky(request):
        attempts.append(request)
        if len(attempts) == 1:
            return openai_httpx.Response(503, json={"error": {"message": "busy"}})
        return router(request)

    client = agentkv.OpenAI(
        api_key="test",
        http_client=openai_httpx.Client(transport=openai_httpx.MockTransport(flaky)),
        max_retries=1,
    )
    with agentkv.session("retry") as session:
        client.chat.completions.create(**chat())
        client.chat.completions.create(**chat())
    assert [a.headers["x-agentkv-turn"] for a in attempts] == ["1", "1", "2"]
    assert [a.headers["x-stainless-retry-count"] for a in attempts] == ["0", "1", "0"]
    assert [turn.turn for turn in session.turns] == [1, 2]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [USER]},
        {"model": "m", "messages": [USER], "prompt_cache_key": None},
        {"model": "m", "messages": [USER], "prompt_cache_key": "mine"},
        {},
    ],
)
def test_the_tagged_body_is_the_callers_json_plus_the_turn(body) -> None:
    router = FakeRouter()
    client = agentkv.OpenAI(api_key="test", http_client=router.http_client())
    with agentkv.session("body") as session:
        client.post("/chat/completions", cast_to=object, body=body)
    (request,) = router.requests
    expected_key = body.get("prompt_cache_key") or "body"
    assert request.body == {
        **body,
        "prompt_cache_key": expected_key,
        "agentkv": {
            "session_id": "body",
            "turn": 1,
            "tool_continuation": False,
            "session_end": False,
            "version": agentkv.__version__,
        },
    }
    assert session.turn == 1
