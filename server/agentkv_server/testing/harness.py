"""A router app driven in-process (``httpx.ASGITransport``) in front of stub engines, or served
on a loopback port where a test must read a stream as it comes.

What unit tests, Redis tests and quick experiments share: start a :class:`StubCluster`'s
engines, build the app from :class:`~agentkv_server.settings.Settings`, run its lifespan, and
wire the engines' holding reports back into the app like a real connector would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.router.app import RouterState, create_app
from agentkv_server.router.sessions import SessionStore
from agentkv_server.settings import Settings
from agentkv_server.testing.stub_engine import StubCluster, StubEngine

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

__all__ = [
    "InProcessRouter",
    "conversation",
    "in_process_router",
    "plan_reason",
    "serve_in_process",
    "serve_on_loopback",
    "tool_result",
    "words",
]


def words(n: int, tag: str = "x") -> str:
    """``n`` stub tokens."""
    return " ".join(f"{tag}{i}" for i in range(n))


def conversation(turns: int, history_words: int) -> list[dict[str, Any]]:
    """An agent's chat history at turn ``turns``: a long system prompt, then user/assistant."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(history_words, "s")}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": "w0 w1 w2 w3"})
        messages.append({"role": "user", "content": f"question {turn}"})
    return messages


def tool_result(history: list[dict[str, Any]], n_words: int) -> list[dict[str, Any]]:
    """``history``'s next turn: a short assistant call, then a tool's ``n_words`` tokens."""
    return [*history, {"role": "assistant", "content": "w0 w1 w2 w3"},
            {"role": "tool", "content": words(n_words, "t")}]  # fmt: skip


def plan_reason(response: httpx.Response) -> str:
    """Why the router planned a turn as it did: the ``desc`` of ``Server-Timing``'s plan."""
    plan = response.headers["server-timing"].split(",")[0].strip()
    assert plan.startswith("plan;dur="), plan
    return plan.partition(";desc=")[2].strip('"')


@dataclass
class InProcessRouter:
    """One router app, a client bound to it, and the stub engines behind it."""

    app: FastAPI
    client: httpx.AsyncClient
    cluster: StubCluster
    prefill: list[StubEngine]
    decode: list[StubEngine]
    secret: str

    @property
    def state(self) -> RouterState:
        return self.app.state.router

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        session: str | None = None,
        headers: dict[str, str] | None = None,
        **body: Any,
    ) -> httpx.Response:
        """One chat turn; returns once the engines' holding reports are in."""
        all_headers = {protocol.HEADER_SESSION_ID: session} if session else {}
        all_headers.update(headers or {})
        payload = {"model": self.cluster.model, "messages": messages, "max_tokens": 4, **body}
        response = await self.client.post("/v1/chat/completions", json=payload, headers=all_headers)
        await self.cluster.flush_reports()
        return response

    async def responses(
        self,
        input: str | list[dict[str, Any]],
        *,
        session: str | None = None,
        headers: dict[str, str] | None = None,
        **body: Any,
    ) -> httpx.Response:
        """One Responses turn; returns once the engines' holding reports are in."""
        all_headers = {protocol.HEADER_SESSION_ID: session} if session else {}
        all_headers.update(headers or {})
        payload = {"model": self.cluster.model, "input": input, "max_output_tokens": 4, **body}
        response = await self.client.post("/v1/responses", json=payload, headers=all_headers)
        await self.cluster.flush_reports()
        return response

    async def report(self, payload: dict[str, Any]) -> None:
        """Deliver a stub engine's holding report to this app, as a connector would."""
        response = await self.client.post(
            wire.REPORT_PATH, json=payload, headers={wire.SECRET_HEADER: self.secret}
        )
        response.raise_for_status()

    async def metric(self, name: str) -> float:
        """Sum of a metric's samples (all label values) in ``/metrics``, read with the shared
        secret (which ``/metrics`` asks for once API keys are configured)."""
        response = await self.client.get("/metrics", headers={wire.SECRET_HEADER: self.secret})
        text = response.text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))
        )

    def engine_requests(self) -> int:
        return sum(len(engine.requests) for engine in self.cluster.engines)


@contextlib.asynccontextmanager
async def serve_in_process(
    settings: Settings, *, store: SessionStore | None = None, timeout_s: float = 5.0
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """A router app from ``settings``, running (lifespan entered), and a client bound to it.

    The engines can be anything: stubs, or the real engines of the engine tier.
    """
    import httpx

    app = create_app(settings, store=store)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://router", timeout=timeout_s) as c,
    ):
        yield app, c


@contextlib.asynccontextmanager
async def serve_on_loopback(app: FastAPI) -> AsyncIterator[str]:
    """``app`` served by uvicorn on a free loopback port in this event loop; yields its URL.

    ``httpx.ASGITransport`` returns a response only once the app has sent all of it, so a test
    that acts on a stream's first chunk needs real HTTP. The app's lifespan is the caller's.
    """
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not (server.started or serving.done()):
            await asyncio.sleep(0.01)
        if serving.done():
            serving.result()  # uvicorn's own error, if it raised one
            raise AssertionError("uvicorn stopped before it served")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


@contextlib.asynccontextmanager
async def in_process_router(
    cluster: StubCluster,
    *,
    n_prefill: int = 1,
    n_decode: int = 1,
    engines: tuple[list[StubEngine], list[StubEngine]] | None = None,
    store: SessionStore | None = None,
    **settings: Any,
) -> AsyncIterator[InProcessRouter]:
    """Start engines in ``cluster`` (or use ``engines``) and a router app in front of them.

    ``settings`` are :class:`Settings` fields; ``store`` (owned by the caller) replaces the
    one they describe. The cluster's reporter is pointed at this app.
    """
    if engines is None:
        engines = (
            [await cluster.start(f"p{i}") for i in range(n_prefill)],
            [await cluster.start(f"d{i}") for i in range(n_decode)],
        )
    prefill, decode = engines
    options: dict[str, Any] = {"health_interval_s": 3600.0} | settings
    config = Settings(
        prefill_urls=tuple(e.url for e in prefill),
        decode_urls=tuple(e.url for e in decode),
        **options,
    )
    async with serve_in_process(config, store=store) as (app, client):
        router = InProcessRouter(
            app, client, cluster, prefill, decode, config.secret.get_secret_value()
        )
        if cluster.reporter is None:
            cluster.reporter = router.report
        yield router
