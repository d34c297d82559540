"""The drop-in clients on the wire, through agentkv.testing.FakeRouter behind a MockTransport."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

import agentkv
from agentkv.testing import FakeRouter, Reply, openai_httpx

USER = {"role": "user", "content": "What is the weather in Paris?"}


def openai_client(handler):
    """An agentkv.OpenAI whose requests go to ``handler`` (a FakeRouter or a function)."""
    return agentkv.OpenAI(
        api_key="test",
        http_client=openai_httpx.Client(transport=openai_httpx.MockTransport(handler)),
    )


def ask(client, messages=(USER,), **kwargs):
    return client.chat.completions.create(model="m", messages=list(messages), **kwargs)


def agentkv_headers(request):
    return {k: v for k, v in request.headers.items() if k.startswith("x-agentkv-")}


# Outside a session: exactly openai.


def test_no_session_sends_what_openai_sends(router, client):
    plain = openai.OpenAI(api_key="test", http_client=router.http_client())
    assert isinstance(ask(client), ChatCompletion)
    ask(plain)
    ours, theirs = router.requests
    assert ours.body == theirs.body
    assert set(ours.headers) == set(theirs.headers)
    assert "x-session-id" not in ours.headers and not agentkv_headers(ours)


async def test_no_session_async(router, async_client):
    await async_client.chat.completions.create(model="m", messages=[USER])
    (request,) = router.requests
    assert "x-session-id" not in request.headers
    assert "agentkv" not in request.body and "prompt_cache_key" not in request.body


# Inside a session.


def test_sync_call_is_tagged_and_returns_openai_types(router, client):
    with agentkv.session("s-1") as s:
        completion = ask(client)
    assert type(completion) is ChatCompletion
    (request,) = router.requests
    assert request.headers["x-session-id"] == "s-1"
    assert request.headers["x-agentkv-turn"] == "1"
    assert request.body["prompt_cache_key"] == "s-1"
    assert request.body["agentkv"]["turn"] == 1
    assert s.turn == 1


async def test_async_call_is_tagged(router, async_client):
    async with agentkv.session("s-2") as s:
        completion = await async_client.chat.completions.create(model="m", messages=[USER])
    assert type(completion) is ChatCompletion
    assert router.requests[0].headers["x-session-id"] == "s-2"
    assert s.last_turn.finish_reason == "stop"


def test_with_raw_response_is_tagged_and_parse_is_observed(router, client):
    """LangChain calls ``create`` through ``with_raw_response``: it must be tagged too."""
    with agentkv.session("s-raw") as s:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=[USER])
        assert raw.headers["x-agentkv-kv-path"] == "reuse"
        completion = raw.parse()
    assert type(completion) is ChatCompletion
    assert router.requests[0].headers["x-session-id"] == "s-raw"
    assert s.last_turn.kv_path == "reuse" and s.last_turn.finish_reason == "stop"


async def test_async_with_raw_response_is_tagged(router, async_client):
    async with agentkv.session("s-araw") as s:
        raw = await async_client.chat.completions.with_raw_response.create(
            model="m", messages=[USER]
        )
        raw.parse()
    assert router.requests[0].headers["x-agentkv-turn"] == "1"
    assert s.last_turn.turn == 1


def test_router_headers_fill_last_turn(client):
    with agentkv.session() as s:
        ask(client)
    assert s.last_turn == agentkv.TurnInfo(
        turn=1,
        tool_continuation=False,
        session_end=False,
        kv_path="reuse",
        reused_tokens=96,
        ttft_seconds=s.last_turn.ttft_seconds,
        finish_reason="stop",
    )
    assert s.last_turn.ttft_seconds >= 0


def test_without_router_headers_last_turn_says_unknown():
    def vllm_without_router(request):
        return openai_httpx.Response(200, json=FakeRouter()(request).json())

    client = openai_client(vllm_without_router)
    with agentkv.session() as s:
        ask(client)
    assert (s.last_turn.kv_path, s.last_turn.reused_tokens) == (None, None)


def test_stream_is_an_observed_openai_stream():
    router = FakeRouter([Reply("hello")])
    client = openai_client(router)
    with agentkv.session() as s:
        stream = ask(client, stream=True)
        assert isinstance(stream, openai.Stream)
        assert s.last_turn is None
        chunks = list(stream)
    assert chunks[0].choices[0].delta.content == "hello"
    assert s.last_turn.finish_reason == "stop"
    assert s.last_turn.ttft_seconds is not None
    assert router.requests[0].body["stream"] is True


async def test_async_stream_is_observed(router, async_client):
    async with agentkv.session() as s:
        stream = await async_client.chat.completions.create(model="m", messages=[USER], stream=True)
        assert isinstance(stream, openai.AsyncStream)
        finish = [chunk.choices[0].finish_reason async for chunk in stream]
    assert finish == [None, "stop"]
    assert s.last_turn.finish_reason == "stop"


def test_stream_closed_early_by_with_is_finalized(client):
    with agentkv.session() as s:
        with ask(client, stream=True) as stream:
            next(stream)
        assert s.last_turn.finish_reason is None
        assert s.last_turn.ttft_seconds is not None


async def test_async_stream_with_is_finalized(async_client):
    async with agentkv.session() as s:
        stream = await async_client.chat.completions.create(model="m", messages=[USER], stream=True)
        async with stream as chunks:
            await chunks.__anext__()
    assert s.last_turn.turn == 1


def sse_chunk(finish_reason=None, content="x"):
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    return f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode()


def test_stream_is_not_buffered():
    produced = []

    def body():
        for part in (sse_chunk(content="first"), sse_chunk("stop"), b"data: [DONE]\n\n"):
            produced.append(part)
            yield part

    client = openai_client(lambda request: openai_httpx.Response(200, content=body()))
    with agentkv.session():
        stream = ask(client, stream=True)
        first = next(stream)
        assert first.choices[0].delta.content == "first"
        assert len(produced) == 1
        assert [chunk.choices[0].finish_reason for chunk in stream] == ["stop"]


async def test_async_stream_is_not_buffered():
    produced = []

    async def body():
        for part in (sse_chunk(content="first"), sse_chunk("stop"), b"data: [DONE]\n\n"):
            produced.append(part)
            yield part

    transport = openai_httpx.MockTransport(
        lambda request: openai_httpx.Response(200, content=body())
    )
    client = agentkv.AsyncOpenAI(
        api_key="test", http_client=openai_httpx.AsyncClient(transport=transport)
    )
    async with agentkv.session():
        stream = await client.chat.completions.create(model="m", messages=[USER], stream=True)
        await stream.__anext__()
        assert len(produced) == 1
        await stream.close()


def run_tool_loop(client, session, turns):
    """A minimal agent: call, run the requested tool, send its result back, until a text answer."""
    messages = [USER]
    for _ in range(turns):
        if session.turn == turns - 1:
            session.end_next_turn()
        message = ask(client, messages).choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(message)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C"})
    raise AssertionError("the loop did not end")


def test_tool_loop_on_the_wire():
    router = FakeRouter([Reply.tool_call("weather", {"city": "Paris"})] * 2 + [Reply("18C")])
    client = openai_client(router)
    with agentkv.session("loop") as s:
        assert run_tool_loop(client, s, turns=3) == "18C"
    headers = [agentkv_headers(request) for request in router.requests]
    assert [r.headers["x-session-id"] for r in router.requests] == ["loop"] * 3
    assert [h["x-agentkv-turn"] for h in headers] == ["1", "2", "3"]
    assert [h["x-agentkv-tool-continuation"] for h in headers] == ["0", "1", "1"]
    assert [h["x-agentkv-session-end"] for h in headers] == ["0", "0", "1"]
    assert "x-agentkv-next-turn-seconds" not in headers[0]
    assert float(headers[1]["x-agentkv-next-turn-seconds"]) >= 0
    assert "x-agentkv-next-turn-seconds" not in headers[2]
    bodies = [request.body["agentkv"] for request in router.requests]
    assert [b["turn"] for b in bodies] == [1, 2, 3]
    assert [b["session_end"] for b in bodies] == [False, False, True]
    assert [t.finish_reason for t in s.turns] == ["tool_calls", "tool_calls", "stop"]
    assert s.predicted_next_turn_seconds is not None


def test_session_end_flag_is_consumed_by_one_call(router, client):
    with agentkv.session() as s:
        s.end_next_turn()
        ask(client)
        ask(client)
    assert [r.headers["x-agentkv-session-end"] for r in router.requests] == ["1", "0"]
    assert [t.session_end for t in s.turns] == [True, False]


def test_recorded_tool_time_is_sent(router, client):
    with agentkv.session() as s:
        s.record_tool_time(2.5)
        ask(client)
    assert router.requests[0].headers["x-agentkv-next-turn-seconds"] == "2.500"
    assert router.requests[0].body["agentkv"]["next_turn_seconds"] == 2.5


async def test_concurrent_tasks_keep_their_own_sessions(router, async_client):
    async def agent(name):
        async with agentkv.session(name):
            for _ in range(3):
                await async_client.chat.completions.create(model="m", messages=[USER])
                await asyncio.sleep(0)

    await asyncio.gather(agent("a"), agent("b"))
    assert_turns_per_session(router, {"a": ["1", "2", "3"], "b": ["1", "2", "3"]})


def test_threads_keep_their_own_sessions(router, client):
    start = threading.Barrier(2)

    def agent(name):
        with agentkv.session(name):
            start.wait()
            for _ in range(3):
                ask(client)

    threads = [threading.Thread(target=agent, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert_turns_per_session(router, {"a": ["1", "2", "3"], "b": ["1", "2", "3"]})


def assert_turns_per_session(router, expected):
    turns = {}
    for request in router.requests:
        turns.setdefault(request.headers["x-session-id"], []).append(
            request.headers["x-agentkv-turn"]
        )
    assert turns == expected


# wrap()


def test_wrap_tags_a_client_built_elsewhere_without_changing_it(router):
    plain = openai.OpenAI(api_key="test", http_client=router.http_client(), max_retries=5)
    wrapped = agentkv.wrap(plain)
    assert type(wrapped) is openai.OpenAI
    assert (wrapped.base_url, wrapped.max_retries) == (plain.base_url, 5)
    with agentkv.session("w"):
        assert type(ask(wrapped)) is ChatCompletion
        ask(plain)
    tagged, untouched = router.requests
    assert tagged.headers["x-session-id"] == "w"
    assert "x-session-id" not in untouched.headers


def test_wrap_is_idempotent_and_survives_with_options(router, client):
    plain = openai.OpenAI(api_key="test", http_client=router.http_client())
    wrapped = agentkv.wrap(plain)
    assert agentkv.wrap(wrapped) is wrapped
    assert agentkv.wrap(client) is client
    with agentkv.session("w"):
        ask(wrapped.with_options(timeout=5))
        ask(agentkv.wrap(wrapped))
    assert [r.headers["x-agentkv-turn"] for r in router.requests] == ["1", "2"]


async def test_wrap_async(router):
    plain = openai.AsyncOpenAI(api_key="test", http_client=router.async_http_client())
    wrapped = agentkv.wrap(plain)
    assert isinstance(wrapped, openai.AsyncOpenAI)
    async with agentkv.session("wa"):
        stream = await wrapped.chat.completions.create(model="m", messages=[USER], stream=True)
        assert [c async for c in stream]
    assert router.requests[0].headers["x-session-id"] == "wa"


def test_wrap_refuses_other_objects():
    with pytest.raises(TypeError):
        agentkv.wrap(object())


# Caller values and options.


def test_caller_values_are_never_clobbered(router, client):
    with agentkv.session("s"):
        ask(client, prompt_cache_key="mine", extra_headers={"X-Session-ID": "theirs", "a": "b"})
    (request,) = router.requests
    assert request.body["prompt_cache_key"] == "mine"
    assert request.headers.get_list("x-session-id") == ["theirs"]
    assert request.headers["a"] == "b"
    assert request.headers["x-agentkv-turn"] == "1"


def test_headers_only_client(router):
    client = agentkv.OpenAI(api_key="test", http_client=router.http_client(), agentkv_body=False)
    with agentkv.session("h"):
        ask(client)
        ask(client.with_options(max_retries=0))
    for request in router.requests:
        assert request.headers["x-session-id"] == "h"
        assert "agentkv" not in request.body and "prompt_cache_key" not in request.body


def test_a_tagging_failure_never_breaks_the_call(router, client, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("agentkv._calls.tag_body", broken)
    with caplog.at_level(logging.ERROR, logger="agentkv"), agentkv.session():
        assert type(ask(client)) is ChatCompletion
    assert "x-session-id" not in router.requests[0].headers
    assert any(record.name == "agentkv" for record in caplog.records)


def test_an_observation_failure_never_breaks_the_call(client, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("agentkv._calls.finish_reason", broken)
    with caplog.at_level(logging.ERROR, logger="agentkv"), agentkv.session():
        assert type(ask(client)) is ChatCompletion
        assert len(list(ask(client, stream=True))) == 2
    assert len([r for r in caplog.records if r.name == "agentkv"]) >= 2


def test_api_errors_are_openai_errors():
    client = openai_client(
        lambda request: openai_httpx.Response(400, json={"error": {"message": "no"}})
    )
    with agentkv.session(), pytest.raises(openai.BadRequestError):
        ask(client)


# The other model-call endpoints.


def test_completions_and_responses_are_tagged():
    router = FakeRouter([Reply(), Reply.tool_call("weather")])
    client = openai_client(router)
    with agentkv.session("e") as s:
        assert type(client.completions.create(model="m", prompt="hi")) is Completion
        assert type(client.responses.create(model="m", input="hi")) is Response
        output = {"type": "function_call_output", "call_id": "call_0", "output": "18C"}
        events = list(client.responses.create(model="m", input=[output], stream=True))
    assert events[-1].type == "response.completed"
    assert [r.path for r in router.requests] == ["/v1/completions", *["/v1/responses"] * 2]
    assert [r.headers["x-agentkv-turn"] for r in router.requests] == ["1", "2", "3"]
    assert router.requests[2].headers["x-agentkv-tool-continuation"] == "1"
    assert "x-agentkv-next-turn-seconds" in router.requests[2].headers
    assert [t.finish_reason for t in s.turns] == ["stop", "tool_calls", "completed"]


def test_legacy_httpx_clients_work_too():
    """LangChain and LlamaIndex still hand openai ``httpx`` (not ``httpx2``) clients."""
    router = FakeRouter()

    def legacy_handler(request: httpx.Request) -> httpx.Response:
        answer = router(request)
        answer.read()
        return httpx.Response(
            answer.status_code, headers=answer.headers.items(), content=answer.content
        )

    http_client = httpx.Client(transport=httpx.MockTransport(legacy_handler))
    client = agentkv.OpenAI(api_key="test", http_client=http_client)
    with agentkv.session("legacy") as s:
        assert len(list(ask(client, stream=True))) == 2
    assert router.requests[0].headers["x-session-id"] == "legacy"
    assert s.last_turn.kv_path == "reuse"
