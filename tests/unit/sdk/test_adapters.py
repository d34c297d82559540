"""agentkv.adapters: what every framework adapter shares, and agentkv.http_client."""

from __future__ import annotations

import httpx
import openai

import agentkv
from agentkv.adapters import SessionCache, ToolTimer, session_id_for
from agentkv.testing import FakeRouter


def test_session_ids_from_any_framework_key():
    assert session_id_for("user-42") == "user-42"
    assert session_id_for(42) == "42"
    digested = session_id_for("user 42 / chat #7")  # a space: digested, never an error
    assert agentkv.protocol.is_valid_session_id(digested)
    assert digested == session_id_for("user 42 / chat #7") != session_id_for("user 42")


def test_cache_keeps_sessions_per_key_and_forgets_the_least_recently_used():
    cache = SessionCache(max_sessions=2)
    first = cache.get("a")
    assert cache.get("a") is first and cache.find("a") is first
    assert cache.find("b") is None
    cache.get("b")
    cache.get("a")  # "a" is now the most recently used
    cache.get("c")
    assert cache.find("b") is None
    assert cache.find("a") is first


def test_tool_timer_feeds_the_session_it_started_in():
    timer: ToolTimer[str] = ToolTimer()
    session = agentkv.session()
    timer.start("call-1", session)
    timer.start("call-2", None)  # outside a session: not timed
    assert session.predicted_next_turn_seconds is None
    timer.stop("call-1")
    timer.stop("call-2")
    timer.stop("never-started")
    assert session.predicted_next_turn_seconds is not None


def test_http_client_wraps_without_changing_and_is_idempotent():
    router = FakeRouter()
    raw = router.http_client()
    tagging = agentkv.http_client(raw)
    assert isinstance(tagging, httpx.Client)
    assert agentkv.http_client(tagging) is tagging
    plain = openai.OpenAI(api_key="test", http_client=tagging)
    untouched = openai.OpenAI(api_key="test", http_client=raw)
    with agentkv.session("raw-http"):
        plain.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        untouched.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    tagged, untagged = router.requests
    assert tagged.headers["x-session-id"] == "raw-http"
    assert "x-session-id" not in untagged.headers


async def test_async_http_client_default_is_openais_and_closes():
    client = agentkv.async_http_client()
    assert isinstance(client, openai.DefaultAsyncHttpxClient)
    async with client as opened:
        assert opened is client
    assert client.is_closed
