"""The three call paths of issue 14's first criterion, with the real libraries, through the real
router served by uvicorn on a loopback port in front of stub engines: openai's
``chat.completions.parse``, LangChain's ``with_structured_output`` and an Agents SDK agent on its
default (Responses) model. Each makes two model calls in one session; the router must see the
session on both and pull the first call's KV for the second.

The router and the engines run on an event loop in a thread of their own, so the blocking clients
(openai, LangChain, ``Runner.run_sync``) can call them from the test's thread. Between the two
calls a test waits for the decode engine's holding report to reach the router, as an agent's
own time between turns would; without it the follow-up could race the report and recompute.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, SQLiteSession
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

import agentkv
from agentkv import protocol
from agentkv_langchain import ChatOpenAI
from agentkv_openai_agents import Runner, conversation_session
from agentkv_server.bench.modes import serve_router
from agentkv_server.settings import Settings
from agentkv_server.testing import StubCluster, StubEngine, http_reporter, words

T = TypeVar("T")
SYSTEM = words(300, "rule")  # long enough that the default policy pulls rather than recomputes


class RouterThread:
    """The router app (default policy) on 127.0.0.1, one prefill and one decode stub engine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster = StubCluster()
        self._stack = contextlib.AsyncExitStack()
        self.url = self.call(self._start())
        self.seen: list[tuple[httpx.Request, httpx.Response]] = []

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    async def _start(self) -> str:
        self.prefill: StubEngine = await self.cluster.start("p0")
        self.decode: StubEngine = await self.cluster.start("d0")
        settings = Settings(
            port=0,
            prefill_urls=(self.prefill.url,),
            decode_urls=(self.decode.url,),
            health_interval_s=3600.0,
        )
        url = await self._stack.enter_async_context(serve_router(settings))
        report, close_reporter = http_reporter(url, settings.secret.get_secret_value())
        self._stack.push_async_callback(close_reporter)
        self.cluster.reporter = report
        return url

    def wait_for_reports(self) -> None:
        self.call(self.cluster.flush_reports())

    def close(self) -> None:
        self.call(self._stack.aclose())
        self.call(self.cluster.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def _record(self, response: httpx.Response) -> None:
        self.seen.append((response.request, response))

    async def _arecord(self, response: httpx.Response) -> None:
        self._record(response)

    def http_client(self) -> httpx.Client:
        """A client that records each model call's request and response headers."""
        return httpx.Client(event_hooks={"response": [self._record]})

    def async_http_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"response": [self._arecord]})

    def turns_by_path(self) -> dict[str, float]:
        """The router's ``agentkv_turns_total`` samples, by KV path."""
        text = httpx.get(f"{self.url}/metrics").text
        (family,) = (f for f in text_string_to_metric_families(text) if f.name == "agentkv_turns")
        return {s.labels["path"]: s.value for s in family.samples if s.name.endswith("_total")}

    def check_one_session_reused(self, session_id: str, path: str) -> None:
        """Both calls carried ``session_id`` to the router, which answered for that session;
        the follow-up reused the first call's KV: pulled from the decode engine that holds it
        (``reuse``), or served on that engine from its prefix cache (``local``), whichever the
        router's cost model chose."""
        calls = [(q, r) for q, r in self.seen if q.url.path == path]
        assert len(calls) == 2, [q.url.path for q, _ in self.seen]
        assert [q.headers[protocol.HEADER_SESSION_ID] for q, _ in calls] == [session_id] * 2
        assert [q.headers[protocol.HEADER_TURN] for q, _ in calls] == ["1", "2"]
        answered = [r.headers[protocol.HEADER_RESPONSE_SESSION_ID] for _, r in calls]
        assert answered == [session_id] * 2
        first, follow_up = (r.headers[protocol.HEADER_KV_PATH] for _, r in calls)
        assert first == "recompute" and follow_up in ("reuse", "local")
        reused = int(calls[1][1].headers[protocol.HEADER_REUSED_TOKENS])
        assert reused > 300
        if follow_up == "reuse":
            ((holder, _, pulled),) = self.prefill.pulled
            assert holder == self.decode.engine_id and pulled == reused
        else:
            assert not self.prefill.pulled
            assert "do_remote_prefill" not in self.decode.completions()[-1].kv_params
        turns = {"local": 0, "reuse": 0, "fallback": 0, "recompute": 1, follow_up: 1}
        assert self.turns_by_path() == turns


@pytest.fixture
def router() -> Iterator[RouterThread]:
    stack = RouterThread()
    yield stack
    stack.close()


class City(BaseModel):
    name: str
    celsius: int


def test_openai_parse_in_a_session_reuses_kv(router: RouterThread) -> None:
    client = agentkv.OpenAI(
        base_url=f"{router.url}/v1", api_key="-", max_retries=0, http_client=router.http_client()
    )
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "warmest city?"},
    ]
    with agentkv.session("parse-loop") as session:
        first = client.chat.completions.parse(
            model=router.cluster.model, messages=messages, response_format=City
        )
        router.wait_for_reports()
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "and the coldest?"},
        ]
        second = client.chat.completions.parse(
            model=router.cluster.model, messages=messages, response_format=City
        )

    assert first.choices[0].message.parsed == second.choices[0].message.parsed
    assert first.choices[0].message.parsed == City(name="w0", celsius=2)
    assert session.turns[1].kv_path in ("reuse", "local")
    router.check_one_session_reused("parse-loop", "/v1/chat/completions")
    forwarded = router.decode.completions()[-1].body["response_format"]
    assert forwarded["json_schema"]["name"] == "City"


class Sum(BaseModel):
    """The sum of two numbers."""

    total: int
    explanation: str


def test_langchain_with_structured_output_in_a_session_reuses_kv(router: RouterThread) -> None:
    model = ChatOpenAI(
        model=router.cluster.model,
        base_url=f"{router.url}/v1",
        api_key="-",
        max_retries=0,
        http_client=router.http_client(),
    )
    structured = model.with_structured_output(Sum)
    history: list[Any] = [SystemMessage(SYSTEM), HumanMessage("add 2 and 2")]

    with agentkv.session("structured-loop") as session:
        first = structured.invoke(history)
        router.wait_for_reports()
        history += [AIMessage(first.model_dump_json()), HumanMessage("and 3 and 3?")]
        second = structured.invoke(history)

    assert first == second == Sum(total=2, explanation="w0")
    assert session.turns[1].kv_path in ("reuse", "local")
    router.check_one_session_reused("structured-loop", "/v1/chat/completions")
    forwarded = router.decode.completions()[-1].body["response_format"]
    assert forwarded["type"] == "json_schema"


@pytest.mark.parametrize(
    ("output_type", "answer"), [(None, "w0 w1 w2 w3 "), (City, City(name="w0", celsius=2))]
)
def test_agents_sdk_default_model_in_a_session_reuses_kv(
    router: RouterThread, output_type: type[City] | None, answer: object
) -> None:
    """The model is a name resolved by the SDK's default provider: OpenAIResponsesModel. With an
    ``output_type`` the SDK asks for structured output in the Responses ``text.format``."""
    client = agentkv.AsyncOpenAI(
        base_url=f"{router.url}/v1",
        api_key="-",
        max_retries=0,
        http_client=router.async_http_client(),
    )
    agent = Agent(
        name="assistant",
        instructions=SYSTEM,
        model=router.cluster.model,
        model_settings=ModelSettings(max_tokens=4),
        output_type=output_type,
    )
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    memory = SQLiteSession(f"agents-loop-{uuid.uuid4().hex}")  # the adapter keeps sessions by id

    first = Runner.run_sync(agent, "hello there", session=memory, run_config=config)
    router.wait_for_reports()
    second = Runner.run_sync(agent, "and then?", session=memory, run_config=config)

    assert first.final_output == second.final_output == answer
    session_id = conversation_session(memory).id
    assert conversation_session(memory).turns[1].kv_path in ("reuse", "local")
    router.check_one_session_reused(session_id, "/v1/responses")
    assert [c.path for c in router.decode.completions()] == ["/v1/responses"] * 2
