"""Every HTTP try of a turn, recorded under openai's own retries (bench/attempts.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

import agentkv
from agentkv_server.bench.attempts import RecordingTransport, attempt_of, recording
from agentkv_server.bench.records import REFUSAL_CODE, Attempt, TenantTurn, TurnRecord

REFUSAL = {"error": {"message": "busy", "type": "server_error", "code": REFUSAL_CODE}}
COMPLETION = {
    "id": "c", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hi"}}],
}  # fmt: skip


def refusal(retry_after: str = "0.01") -> httpx.Response:
    headers = {"retry-after": retry_after, "x-should-retry": "true"}
    return httpx.Response(503, json=REFUSAL, headers=headers)


def client(answers: list[httpx.Response | Exception], retries: int = 2) -> agentkv.AsyncOpenAI:
    def answer(request: httpx.Request) -> httpx.Response:
        given = answers.pop(0)
        if isinstance(given, Exception):
            raise given
        return given

    transport = RecordingTransport(httpx.MockTransport(answer))
    http = httpx.AsyncClient(transport=transport)
    return agentkv.AsyncOpenAI(
        base_url="http://router/v1", api_key="k", http_client=http, max_retries=retries
    )


async def ask(openai_client: agentkv.AsyncOpenAI) -> str | None:
    reply = await openai_client.chat.completions.create(model="m", messages=[])
    return reply.choices[0].message.content


async def test_refusals_are_recorded_and_the_client_still_retries_them() -> None:
    served = httpx.Response(200, json=COMPLETION, headers={
        "server-timing": 'plan;dur=1.5, queue;dur=2500;desc="follow_up", prefill;dur=30'
    })  # fmt: skip
    with recording() as tries:
        assert await ask(client([refusal(), refusal("0.02"), served])) == "hi"
    first, second, answered = tries
    assert first.refused and first.retry_after_s == 0.01 and first.should_retry is True
    assert second.retry_after_s == 0.02 and first.seconds < 0.5
    assert not answered.refused and answered.status == 200
    assert (answered.queue_s, answered.queue_priority) == (2.5, "follow_up")


async def test_a_refusal_on_every_try_reaches_the_client_as_the_routers_error() -> None:
    with recording() as tries, pytest.raises(openai.InternalServerError) as raised:
        await ask(client([refusal(), refusal(), refusal()]))
    assert len(tries) == 3 and all(t.refused for t in tries)  # openai's default: 2 retries
    assert raised.value.code == REFUSAL_CODE  # the body was handed on unread
    turn = TenantTurn(TurnRecord("agentkv", 0, 100, 0, 1, 0.0, error="503"), "burst", tuple(tries))
    assert turn.outcome == "refused" and len(turn.refusals) == 3


async def test_a_deadline_is_not_retried_and_counts_as_a_failed_accepted_turn() -> None:
    timeout = {"error": {"message": "late", "type": "server_error", "code": "turn_timeout"}}
    late = httpx.Response(504, json=timeout, headers={"x-should-retry": "false"})
    with recording() as tries, pytest.raises(openai.APIStatusError):
        await ask(client([refusal(), late]))
    assert [t.status for t in tries] == [503, 504] and tries[1].code == "turn_timeout"
    turn = TenantTurn(TurnRecord("agentkv", 0, 100, 0, 1, 0.0, error="504"), "burst", tuple(tries))
    assert turn.outcome == "failed" and len(turn.refusals) == 1


async def test_a_try_without_an_answer_is_recorded_with_its_error() -> None:
    with recording() as tries, pytest.raises(openai.APIConnectionError):
        await ask(client([httpx.ConnectError("refused")] * 2, retries=1))
    assert [(t.status, (t.error or "").split(":")[0]) for t in tries] == [
        (None, "ConnectError")
    ] * 2


async def test_nothing_is_recorded_outside_a_turn() -> None:
    with recording() as tries:
        pass
    assert await ask(client([httpx.Response(200, json=COMPLETION)])) == "hi"
    assert tries == []


def test_headers_the_router_may_leave_out_read_as_absent() -> None:
    attempt = attempt_of(503, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.1, "overloaded")
    assert attempt == Attempt(503, 0.1, "overloaded")  # a date is no delay in seconds
    bare = attempt_of(200, {"server-timing": "plan;dur=2"}, 0.2)
    assert (bare.queue_s, bare.queue_priority, bare.should_retry) == (None, None, None)
    assert json.loads(json.dumps(attempt.__dict__)) == attempt.__dict__
