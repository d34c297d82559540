"""The Responses API (POST /v1/responses) through the router: the same P/D turn as chat, stateless."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv_server.router.formats import wire_format
from agentkv_server.testing.harness import InProcessRouter
from agentkv_server.wire import cold_prefill_params

SYSTEM = " ".join(f"rule{i}" for i in range(500))


def history(turns: int) -> list[dict[str, Any]]:
    """A growing agent history as Responses input items: each turn adds an answer and a question."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "q0 please"}]
    for turn in range(1, turns):
        answer = [{"type": "output_text", "text": "w0 w1 w2 w3", "annotations": []}]
        items += [
            {"type": "message", "role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "input_text", "text": f"q{turn} more"}]},
        ]
    return items


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event."""
    parsed = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        parsed.append((lines["event"], json.loads(lines["data"])))
    return parsed


async def test_cold_turn_prefills_one_token_then_decodes(make_router):
    router = await make_router()
    response = await router.responses(
        history(1), instructions=SYSTEM, prompt_cache_key="s1", store=True, agentkv={"turn": 1}
    )

    assert response.status_code == 200
    answer = response.json()
    assert answer["object"] == "response"
    assert answer["output"][0]["content"][0]["text"] == "w0 w1 w2 w3 "
    assert "kv_transfer_params" not in answer
    assert response.headers["x-agentkv-session-id"] == "s1"
    assert response.headers["x-agentkv-kv-path"] == "recompute"

    (prefill,) = router.prefill[0].completions()
    assert prefill.path == "/v1/responses"
    assert prefill.body["max_output_tokens"] == 1 and prefill.body["stream"] is False
    assert prefill.kv_params == cold_prefill_params()
    (decode,) = router.decode[0].completions()
    assert decode.path == "/v1/responses"
    assert decode.body["max_output_tokens"] == 4
    assert decode.kv_params["remote_engine_id"] == router.prefill[0].engine_id
    assert decode.kv_params["agentkv_ticket"]
    for sent in (prefill, decode):  # the router's own fields and storage stop at the router
        assert not {"prompt_cache_key", "agentkv", "store"} & sent.body.keys()

    holding = await router.state.store.take("s1")
    assert holding is not None and holding.decode_url == router.decode[0].url
    assert holding.num_tokens == (2 + 500) + (2 + 2) + 4  # instructions, message, output


async def test_second_turn_pulls_the_holders_kv(make_router):
    router = await make_router()
    await router.responses(history(1), instructions=SYSTEM, session="s1")
    (held_id,) = router.decode[0].retained

    response = await router.responses(history(2), instructions=SYSTEM, session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "reuse"
    held = 502 + 4 + 4
    assert response.headers["x-agentkv-reused-tokens"] == str(held)
    assert router.prefill[0].pulled == [(router.decode[0].engine_id, held_id, held)]
    pull = router.prefill[0].completions()[-1].kv_params
    assert pull["remote_request_id"] == held_id and pull["do_remote_decode"] is True
    assert await router.metric('agentkv_turns_total{path="reuse"}') == 1
    assert await router.metric("agentkv_reused_tokens_total") == held


async def test_streamed_turn_records_its_holding_from_the_completed_event(make_router):
    router = await make_router()

    async def lost(_: dict[str, Any]) -> None:  # no decode report ever reaches the router
        return None

    router.cluster.reporter = lost
    response = await router.responses(history(1), instructions=SYSTEM, session="s1", stream=True)

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    streamed = events(response.text)
    names = [name for name, _ in streamed]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    deltas = "".join(data["delta"] for name, data in streamed if name.endswith(".delta"))
    assert deltas == "w0 w1 w2 w3 "
    final = streamed[-1][1]["response"]
    assert "kv_transfer_params" not in final
    assert final["usage"]["output_tokens"] == 4

    response = await router.responses(history(2), instructions=SYSTEM, session="s1", stream=True)
    assert response.headers["x-agentkv-kv-path"] == "reuse"
    assert events(response.text)[-1][0] == "response.completed"


async def test_sessionless_turn_keeps_nothing(make_router):
    router = await make_router()
    response = await router.responses("hello there")

    assert response.status_code == 200
    assert "x-agentkv-session-id" not in response.headers
    (decode,) = router.decode[0].completions()
    assert "agentkv_ticket" not in decode.kv_params
    assert router.decode[0].retained == {}


def test_a_completed_event_split_across_chunks_is_edited_whole():
    editor = wire_format("responses").stream_editor()
    response = {"id": "r", "status": "completed", "kv_transfer_params": {"remote_num_tokens": 9}}
    stream = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
        b"event: response.completed\ndata: "
        + json.dumps({"type": "response.completed", "response": response}).encode()
        + b"\n\n"
    )
    passed, final = b"", None
    for index in range(len(stream)):  # one byte at a time: the worst a network can do
        head, tail = editor.feed(stream[index : index + 1])
        passed += head
        final = tail if tail is not None else final
    passed += editor.flush()

    assert passed == stream[: stream.index(b"event: response.completed")]
    assert final is not None and b"kv_transfer_params" not in final
    assert events(final.decode())[0][1]["response"] == {"id": "r", "status": "completed"}
    assert editor.kv_transfer_params == {"remote_num_tokens": 9}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"model": ""}, "model"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "8"}, "max_output_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"prompt_cache_key": "bad id!"}, "prompt_cache_key"),
    ],
)
async def test_bad_input_is_refused_naming_the_field(make_router, change, param):
    router: InProcessRouter = await make_router()
    body = {"model": router.cluster.model, "input": "hello", **change}
    body = {key: value for key, value in body.items() if value is not None}

    response = await router.client.post("/v1/responses", json=body)

    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert param in response.json()["error"]["message"]
    assert router.engine_requests() == 0


async def test_an_engines_own_refusal_comes_back_as_it_wrote_it(make_router):
    router = await make_router()
    response = await router.responses("hello", max_output_tokens=5000)  # over the stub's context

    assert response.status_code == 400
    assert "max_output_tokens" in response.json()["error"]["message"]


def test_events_after_the_completed_event_in_one_chunk_follow_it_once():
    editor = wire_format("responses").stream_editor()
    completed = {"type": "response.completed", "response": {"kv_transfer_params": {"a": 1}}}
    trailer = b"event: response.done\ndata: {}\n\n"
    chunk = b"event: response.completed\ndata: " + json.dumps(completed).encode() + b"\n\n"

    head, final = editor.feed(chunk + trailer + b"event: part")

    assert head == b""
    assert final is not None and final.endswith(trailer + b"event: part")
    assert editor.flush() == b""
    assert editor.kv_transfer_params == {"a": 1}
