"""Adapter tests run real framework objects against agentkv's fake router (agentkv.testing).

Its model here calls a tool ``tool_rounds`` times after each user message and then replies in
text (at once when ``tool_choice`` is ``none``, never when it is ``required`` or names a
function; with a JSON schema response format, a sample of the schema). A session's first turn
reports ``recompute``, later ones ``reuse``, as the router does. Tests reach it in-process
through a mock transport (``http_client`` fixtures) or over loopback (``loopback_url``), which is
how the examples, run as subprocesses, see it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from agentkv.testing import FakeRouter, RecordedRequest, Reply, serve

MODEL = "agentkv-fake"
_SAMPLE_BY_TYPE = {"integer": 2, "number": 2.5, "string": "paris", "boolean": True}


def tool_loop_model(tool_rounds: int) -> Callable[[dict[str, Any]], Reply]:
    """A model that calls a tool ``tool_rounds`` times per user message, then answers."""
    calls = iter(range(1_000_000))

    def reply(body: dict[str, Any]) -> Reply:
        response_format = body.get("response_format") or {}
        if response_format.get("type") == "json_schema":
            return Reply(json.dumps(_arguments(response_format["json_schema"]["schema"])))
        tools = body.get("tools") or []
        choice = body.get("tool_choice")
        rounds = _tool_results_since_user(body["messages"])
        if not tools or choice == "none" or (rounds >= tool_rounds and choice in (None, "auto")):
            return Reply(f"done after {rounds} tool results")
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        tool = next(t["function"] for t in tools if name in (None, t["function"]["name"]))
        arguments = _arguments(tool.get("parameters") or {})
        return Reply.tool_call(tool["name"], arguments, call_id=f"call_{next(calls)}")

    return reply


def check_tool_loop(
    requests: list[RecordedRequest], *, session_id: str | None = None, first_turn: int = 1
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
    flagged = [r.tool_continuation for r in requests]
    assert flagged == [r.body["messages"][-1]["role"] == "tool" for r in requests]
    assert flagged[1:] == [True] * (len(requests) - 1)
    assert all(r.body["prompt_cache_key"] == found for r in requests)
    assert all(r.body["agentkv"]["turn"] == r.turn for r in requests)
    return found


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


class ToolLoopRouter(FakeRouter):
    """The fake router with the tool-loop model, and the check of what reached it."""

    check_tool_loop = staticmethod(check_tool_loop)


@pytest.fixture
def server() -> ToolLoopRouter:
    return ToolLoopRouter(
        model=tool_loop_model(tool_rounds=2), cold_first_turn=True, model_name=MODEL
    )


@pytest.fixture
def http_client(server: FakeRouter) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(server))


@pytest.fixture
def async_http_client(server: FakeRouter) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(server))


@pytest.fixture
def loopback_url(server: FakeRouter) -> Iterator[str]:
    with serve(server) as base_url:
        yield base_url
