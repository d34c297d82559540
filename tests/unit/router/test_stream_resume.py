"""A decode stream that breaks after its first chunk is continued on another decode engine:
the client sees one unbroken answer (docs/faults.md, "A stream that breaks")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv_server import wire
from agentkv_server.router.resume import ResumableStream, continuation_body
from agentkv_server.testing import InProcessRouter, conversation, words
from agentkv_server.testing.stub_shapes import OUTPUT_TOKEN_ID, PROMPT_TOKEN_ID

N = 8


def chunks(text: str) -> list[dict[str, Any]]:
    """The stream's data events; asserts it ends with exactly one ``[DONE]``."""
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def complete(router: InProcessRouter, **body: Any) -> list[dict[str, Any]]:
    payload = {"model": router.cluster.model, "prompt": words(40), "max_tokens": N, **body}
    response = await router.client.post("/v1/completions", json={"stream": True, **payload})
    assert response.status_code == 200
    return chunks(response.text)


def answer(events: list[dict[str, Any]], field: str = "text") -> str:
    return "".join(
        c[field] if field == "text" else c["delta"]["content"] for e in events for c in e["choices"]
    )


@pytest.mark.parametrize("cleanly", [False, True], ids=["connection-dropped", "ended-early"])
async def test_broken_completion_stream_is_continued_with_its_token_ids(make_router, cleanly):
    router = await make_router(n_decode=2)
    broken, other = router.decode
    broken.cut_after_chunks, broken.cut_cleanly = 3, cleanly

    events = await complete(router)

    assert answer(events) == "".join(f"w{i} " for i in range(N))  # each token once, in order
    assert {e["id"] for e in events} == {events[0]["id"]}
    # The client did not ask for token ids: its chunks read as if nobody had.
    assert all(
        c["token_ids"] is None and c["prompt_token_ids"] is None
        for e in events
        for c in e["choices"]
    )
    first, continuation = broken.completions()[-1].body, other.completions()[-1].body
    assert first["return_token_ids"] is True
    prompt_ids = [PROMPT_TOKEN_ID + i for i in range(40)]
    assert continuation["prompt"] == prompt_ids + [OUTPUT_TOKEN_ID + i for i in range(3)]
    assert continuation["max_tokens"] == N - 3
    assert wire.DO_REMOTE_PREFILL not in continuation.get(wire.KV_TRANSFER_PARAMS, {})
    assert await router.metric('agentkv_engine_errors_total{kind="stream",role="decode"}') == 1
    assert await router.metric("agentkv_streams_resumed_total") == 1
    assert router.state.decode.engines[0].healthy is False


async def test_continued_completion_keeps_asked_for_ids_and_counts_usage_whole(make_router):
    router = await make_router(n_decode=2)
    router.decode[0].cut_after_chunks = 5
    prompt = list(range(10, 40))

    events = await complete(
        router, prompt=prompt, return_token_ids=True, stream_options={"include_usage": True}
    )

    ids = [t for e in events for c in e["choices"] for t in c["token_ids"] or ()]
    assert ids == [OUTPUT_TOKEN_ID + i for i in range(N)]
    assert events[-1]["usage"] == {"prompt_tokens": 30, "completion_tokens": N, "total_tokens": 38}
    assert router.decode[1].completions()[-1].body["prompt"] == prompt + ids[:5]


async def test_broken_chat_stream_is_continued_as_the_final_assistant_message(make_router):
    router = await make_router(n_decode=2)
    router.decode[0].cut_after_chunks = 3
    messages = conversation(1, 50)

    response = await router.chat(messages, stream=True, max_tokens=N)

    events = chunks(response.text)
    assert answer(events, "delta") == "".join(f"w{i} " for i in range(N))
    continuation = router.decode[1].completions()[-1].body
    assert continuation["messages"] == [*messages, {"role": "assistant", "content": "w0 w1 w2 "}]
    assert continuation["continue_final_message"] is True
    assert continuation["add_generation_prompt"] is False
    assert continuation["max_tokens"] == N - 3


async def test_resumed_turn_leaves_the_session_held_on_the_continuing_engine(make_router):
    router = await make_router(n_decode=2)
    broken, other = router.decode
    broken.cut_after_chunks = 2

    await router.chat(conversation(1, 500), session="s1", stream=True, max_tokens=N)
    response = await router.chat(conversation(2, 500), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    assert router.prefill[0].completions()[-1].kv_params["remote_engine_id"] == other.engine_id


async def test_continuations_are_bounded(make_router):
    router = await make_router(n_decode=3, faults={"stream_resumes": 1})
    for engine in router.decode:
        engine.cut_after_chunks = 1

    response = await router.chat(conversation(1, 50), stream=True, max_tokens=N)

    assert response.text.count("data: ") == 2 and "[DONE]" not in response.text
    assert await router.metric("agentkv_streams_resumed_total") == 1
    assert await router.metric('agentkv_engine_errors_total{kind="stream",role="decode"}') == 2


def test_a_stream_whose_tool_call_began_is_not_continued():
    editor = ResumableStream("chat", client_wants_ids=False)
    delta = {"tool_calls": [{"index": 0, "function": {"name": "get", "arguments": '{"ci'}}]}
    chunk = {"id": "c", "created": 1, "choices": [{"index": 0, "delta": delta}]}
    head, final = editor.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert head and final is None

    progress = editor.progress()

    assert progress.blocker_for({"messages": []}) == "a tool call had begun"


def test_an_answer_complete_before_the_break_only_needs_its_end():
    editor = ResumableStream("completion", client_wants_ids=False)
    chunk = {
        "id": "c",
        "choices": [{"index": 0, "text": "a", "token_ids": [5], "finish_reason": "length"}],
    }
    editor.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    progress = editor.progress()

    assert progress.blocker_for({"prompt": [1, 2]}) is None
    assert continuation_body({"prompt": [1, 2], "max_tokens": 1}, progress) is None
    assert editor.finish() == b"data: [DONE]\n\n"


def test_half_an_event_is_never_passed_on():
    editor = ResumableStream("completion", client_wants_ids=False)
    event = b'data: {"choices":[{"text":"a","prompt_token_ids":[1,2],"token_ids":[5]}]}\n\n'

    head, _ = editor.feed(event[:20])
    rest, _ = editor.feed(event[20:])

    assert head == b""
    assert rest == b'data: {"choices":[{"text":"a","prompt_token_ids":null,"token_ids":null}]}\n\n'
    assert editor.progress().token_ids == [5]
