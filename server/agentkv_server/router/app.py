"""The router's FastAPI app: OpenAI-compatible endpoints in front of prefill and decode engines.

Routes:
  POST   /v1/chat/completions, /v1/completions   turns (streamed or not), see orchestrator/
  POST   /v1/responses                            the same, stateless (formats.py)
  GET    /v1/models                               an engine's model list
  DELETE /v1/sessions/{id}                        end a session, release its KV
  POST   /internal/v1/kv-holdings                 decode engines' holding reports (shared secret)
  GET    /health, /metrics                        engine health; Prometheus text

Who may call which is decided before any route runs (guard.py, auth.py, docs/security.md).
Everything that lives as long as the app (the HTTP client, the store, the health loop) is
created in the lifespan and closed with it. Tests drive the app in-process with
``httpx.ASGITransport`` inside ``app.router.lifespan_context(app)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.router.auth import (
    METRICS_PATH,
    AccessPolicy,
    session_key,
)
from agentkv_server.router.capacity import CapacityLedger
from agentkv_server.router.errors import ClientGone, RouterError, install_error_handlers
from agentkv_server.router.fastpath import FastRoutes, Handler
from agentkv_server.router.formats import Endpoint
from agentkv_server.router.guard import TENANT_STATE, RequestGuard
from agentkv_server.router.holdings import HoldingKeeper
from agentkv_server.router.http_client import HTTPClient, HTTPError, Timeout
from agentkv_server.router.intake import read_json, read_request
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.orchestrator import Orchestrator
from agentkv_server.router.placement import Engine, EnginePool, HealthMonitor
from agentkv_server.router.policy import CostModelPolicy, ReusePolicy, make_policy
from agentkv_server.router.queue import Priority, StepQueue
from agentkv_server.router.redis_store import RedisStore
from agentkv_server.router.resilient_store import ResilientStore
from agentkv_server.router.sessions import InMemoryStore, SessionStore
from agentkv_server.router.streaming import unless_client_leaves
from agentkv_server.settings import Settings

__all__ = ["RouterState", "create_app"]

logger = logging.getLogger(__name__)


@dataclass
class RouterState:
    """Everything one running router holds; ``app.state.router`` while the app runs."""

    settings: Settings
    prefill: EnginePool
    decode: EnginePool
    policy: ReusePolicy
    metrics: RouterMetrics
    store: ResilientStore
    http: HTTPClient
    keeper: HoldingKeeper
    health: HealthMonitor
    orchestrator: Orchestrator
    ledger: CapacityLedger


def create_app(
    settings: Settings, *, store: SessionStore | None = None, policy: ReusePolicy | None = None
) -> FastAPI:
    """A router app. ``store`` (owned by the caller) replaces the one the settings describe."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = _start(settings, store, policy or make_policy(settings))
        state.health.start()
        state.keeper.start()
        app.state.router = state
        try:
            yield
        finally:
            await state.health.stop()
            await state.keeper.drain()
            await state.http.close()
            if store is None:
                await state.store.close()

    app = FastAPI(
        title="agentkv router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    install_error_handlers(app)
    app.add_middleware(FastRoutes, routes=_FAST_ROUTES)  # inside the guard: it runs first
    app.add_middleware(
        RequestGuard,
        policy=AccessPolicy(
            api_keys=[key.get_secret_value() for key in settings.api_keys],
            secret=settings.secret.get_secret_value(),
        ),
        max_header_count=settings.max_header_count,
        max_header_bytes=settings.max_header_bytes,
    )
    _add_routes(app)
    return app


def _start(settings: Settings, store: SessionStore | None, policy: ReusePolicy) -> RouterState:
    http = HTTPClient(
        max_connections=settings.max_connections,
        max_per_origin=settings.max_connections_per_engine,
    )
    metrics = RouterMetrics()
    resilient = ResilientStore(
        store or _make_store(settings),
        metrics=metrics,
        timeout_s=settings.timeouts.store_s,
        retry_after_s=settings.store_retry_s,
    )
    on_down = _count_marked_down(metrics)
    prefill = EnginePool(
        "prefill", settings.prefill_urls, queue=_prefill_queue(settings, policy), on_down=on_down
    )
    decode = EnginePool("decode", settings.decode_urls, last_resort=True, on_down=on_down)
    ledger = _make_ledger(settings, policy, metrics)
    keeper = HoldingKeeper(
        resilient,
        http,
        safety_margin_s=settings.retention.safety_margin_s,
        release_timeout_s=settings.timeouts.release_s,
        releases_enabled=policy.sends_hints,
        ledger=ledger,
        sweep_s=settings.capacity.sweep_s,
        # A pull held in the router's queue keeps its holding a retention slack at a time,
        # renewed once P might not read it in time: P's queue, then the expiry guard.
        renew_s=settings.retention.slack_s,
        renew_margin_s=settings.admission.prefill_queue_s + settings.cost.expiry_guard_s + 5.0,
    )
    return RouterState(
        settings=settings,
        prefill=prefill,
        decode=decode,
        policy=policy,
        metrics=metrics,
        store=resilient,
        http=http,
        keeper=keeper,
        health=HealthMonitor(
            (prefill, decode),
            http,
            interval_s=settings.health_interval_s,
            timeout_s=settings.timeouts.health_s,
        ),
        orchestrator=Orchestrator(settings, http, prefill, decode, keeper, policy, metrics),
        ledger=ledger,
    )


def _prefill_queue(settings: Settings, policy: ReusePolicy) -> Callable[[], StepQueue]:
    """Each prefill engine's queue: holding back what the engine need not have yet, priced at
    the policy's prefill rate until the engine served a step."""
    admission = settings.admission
    hold_beyond_s = admission.prefill_queue_s if admission.enabled else None
    prior = _prefill_rate(settings, policy)
    return lambda: StepQueue(hold_beyond_s=hold_beyond_s, prior_s_per_token=prior)


def _count_marked_down(metrics: RouterMetrics) -> Callable[[Engine, str], None]:
    def marked_down(engine: Engine, why: str) -> None:
        metrics.record_marked_down(engine.role, why)

    return marked_down


def _make_ledger(settings: Settings, policy: ReusePolicy, metrics: RouterMetrics) -> CapacityLedger:
    """The capacity ledger; it sheds holdings only where the policy manages capacity."""
    capacity = settings.capacity
    if not policy.manages_capacity:
        capacity = capacity.model_copy(update={"enabled": False})
    return CapacityLedger(
        capacity,
        metrics,
        default_gap_s=settings.retention.default_s,
        prefill_s_per_token=_prefill_rate(settings, policy),
    )


def _prefill_rate(settings: Settings, policy: ReusePolicy) -> Callable[[], float]:
    """The policy's fitted seconds per prefilled token; the prior where it fits none."""
    if isinstance(policy, CostModelPolicy):
        fitted = policy
        return lambda: fitted.prefill_s_per_token
    prior = 1.0 / settings.cost.prefill_tokens_per_s
    return lambda: prior


def _make_store(settings: Settings) -> SessionStore:
    # A ticket (and an ended session's tombstone) must outlive the longest turn.
    ticket_ttl_s = settings.timeouts.first_token_s + settings.timeouts.decode_s + 60.0
    if settings.redis_url:
        return RedisStore.from_url(
            settings.redis_url,
            timeout_s=settings.timeouts.store_s,
            prefix=settings.redis_prefix,
            max_sessions=settings.max_sessions,
            ticket_ttl_s=ticket_ttl_s,
        )
    return InMemoryStore(max_sessions=settings.max_sessions, ticket_ttl_s=ticket_ttl_s)


async def _serve_turn(request: Request, endpoint: Endpoint) -> Response:
    """Read one turn of ``endpoint`` from ``request`` and run it through P and D."""
    started = time.monotonic()
    state = _state(request)
    settings = state.settings
    turn = await read_request(
        request,
        endpoint,
        settings.max_body_bytes,
        _tenant(request),
        max_json_depth=settings.max_json_depth,
    )
    return await unless_client_leaves(request.receive, state.orchestrator.serve(turn, started))


async def _chat_completions(request: Request) -> Response:
    return await _serve_turn(request, "chat")


async def _completions(request: Request) -> Response:
    return await _serve_turn(request, "completion")


async def _responses(request: Request) -> Response:
    return await _serve_turn(request, "responses")


async def _report_holding(request: Request) -> Response:
    # The guard has checked the shared secret.
    state = _state(request)
    report = await read_json(request, state.settings.max_body_bytes, state.settings.max_json_depth)
    if not (
        isinstance(report.get(wire.REPORT_TICKET), str)
        and isinstance(report.get(wire.KV_TRANSFER_PARAMS), dict)
    ):
        raise RouterError(
            400,
            f"Report needs '{wire.REPORT_TICKET}' (string) and "
            f"'{wire.KV_TRANSFER_PARAMS}' (object).",
            code="invalid_report",
        )
    # A streamed turn's D says here how its read of P's KV went (pairs.py) and how long it
    # waited for blocks (blockwaits.py).
    state.orchestrator.record_report(report[wire.REPORT_TICKET], report[wire.KV_TRANSFER_PARAMS])
    await state.keeper.record(
        report[wire.REPORT_TICKET], report[wire.KV_TRANSFER_PARAMS], reported=True
    )
    return Response(status_code=204)


def _client_may_leave(handler: Handler) -> Handler:
    """``handler``, where a client that leaves before its answer (ClientGone) is a normal
    event: counted and logged without a traceback, its (unsent) answer a bare 499."""

    async def serve(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientGone as gone:
            _state(request).metrics.record_client_disconnect(gone.phase)
            log = logger.info if gone.phase == "turn" else logger.debug
            log("%s %s: %s", request.method, request.url.path, gone)
            return Response(status_code=499)

    return serve


_FAST_ROUTES = {
    path: _client_may_leave(handler)
    for path, handler in {
        "/v1/chat/completions": _chat_completions,
        "/v1/completions": _completions,
        "/v1/responses": _responses,
        wire.REPORT_PATH: _report_holding,
    }.items()
}
"""The POST routes of every turn, served by :class:`FastRoutes` ahead of FastAPI's routing."""


def _state(request: Request) -> RouterState:
    return request.app.state.router


def _tenant(request: Request) -> str | None:
    return getattr(request.state, TENANT_STATE, None)


def _add_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state = _state(request)
        timeout = Timeout(total=state.settings.timeouts.health_s)
        for engine in [*state.decode.engines, *state.prefill.engines]:
            if not engine.healthy:
                continue
            try:
                answer = await state.http.fetch(f"{engine.url}/v1/models", timeout)
            except (HTTPError, asyncio.TimeoutError):
                continue
            if answer.status == 200:
                return Response(answer.body, media_type="application/json")
        raise RouterError(
            503, "No engine answered /v1/models.", type="server_error", code="no_engine_available"
        )

    @app.delete("/v1/sessions/{session_id:path}")
    async def end_session(session_id: str, request: Request) -> Response:
        if not protocol.is_valid_session_id(session_id):
            raise RouterError(
                400, "Invalid session id.", param="session_id", code="invalid_session_id"
            )
        state = _state(request)
        holding, released = await state.keeper.end(session_key(_tenant(request), session_id))
        if holding is None and not state.store.available:
            raise RouterError(
                503,
                "The session store is unavailable; try again later.",
                type="server_error",
                code="store_unavailable",
            )
        if holding is None:
            raise RouterError(
                404,
                f"No KV is held for session {session_id!r}.",
                type="not_found_error",
                param="session_id",
                code="session_not_found",
            )
        body = {
            "id": session_id,
            "object": "session.deleted",
            "deleted": True,
            "released": released,
            "released_tokens": holding.num_tokens if released else 0,
        }
        return JSONResponse(body)

    @app.get("/health")
    async def health(request: Request) -> Response:
        state = _state(request)
        engines = [*state.prefill.engines, *state.decode.engines]
        healthy = all(engine.healthy for engine in engines) and state.store.available
        status = "ok" if healthy else "degraded"
        if not state.decode.any_healthy():
            status = "unavailable"
        body = {
            "status": status,
            "policy": state.policy.name,
            "store": "redis" if isinstance(state.store.inner, RedisStore) else "memory",
            "store_available": state.store.available,
            "prefill": [engine.snapshot() for engine in state.prefill.engines],
            "decode": [engine.snapshot() for engine in state.decode.engines],
        }
        return JSONResponse(body, status_code=200 if state.decode.any_healthy() else 503)

    @app.get(METRICS_PATH)
    async def metrics(request: Request) -> Response:
        state = _state(request)
        queues = [(engine.url, engine.backlog_s) for engine in state.prefill.engines]
        shares = [
            (engine.url, share)
            for engine in state.decode.engines
            if (share := engine.steps.slowed_share) is not None
        ]
        waiting = [
            (priority.label, sum(e.queue.held_count(priority) for e in state.prefill.engines))
            for priority in Priority
        ]
        text = state.metrics.render(
            await state.store.count(), state.ledger.figures(), queues, shares, waiting
        )
        return Response(text, media_type=CONTENT_TYPE_LATEST)
