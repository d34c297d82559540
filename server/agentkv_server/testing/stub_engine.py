"""A stub vLLM engine on a loopback port: OpenAI API plus the kv_transfer_params protocol.

It behaves like a bidirectional NixlConnector engine with agentkv's connector, minus the model:

- a prefill step (``do_remote_decode: true``) answers one token and params a decode engine can
  pull; when the params name a holder (``remote_engine_id``, ``remote_request_id``) it "pulls"
  the holder's retained KV from the :class:`StubCluster` (standing in for NIXL), reporting the
  pulled tokens as ``usage.prompt_tokens_details.cached_tokens``; a holder that is gone or
  expired means a silent recompute (``kv_load_failure_policy: recompute``);
- a decode step generates ``max_tokens`` words (streamed or not), retains the request's KV for
  ``agentkv_retention_seconds`` (upstream's 480 s without it), returns the holding params with
  ``agentkv_expires_in_seconds``, and reports them through the cluster's reporter when the
  request carried an ``agentkv_ticket``;
- a decode step that reads a prefill engine's KV (``do_remote_prefill``) says how that load
  went, as agentkv's connector does (``agentkv_kv_load``, ``agentkv_kv_load_from``): ``ok``, or
  ``failed`` while ``kv_load_fails`` is set (the step then computes the prompt itself);
- while ``blocks_wait`` is set, a decode step says it waited that long for KV blocks (seconds,
  and those of them beside retained holdings), as agentkv's connector does;
- ``agentkv_release`` frees retained requests at once, ``agentkv_renew`` keeps them longer;
- a non-streamed request with a JSON-schema format is answered with a sample of the schema
  (stub_shapes.py), so openai's ``parse`` helpers accept it.

A token is one whitespace-separated word (chat: every message's content plus two per message
for the template). Every request is recorded for assertions; faults can be queued. ``/metrics``
counts prompt and generated tokens as vLLM's counters do, and moves its KV cache usage gauge
every ``chunk_s`` while it computes a prompt, as vLLM's chunked prefill does step by step;
``frozen`` makes the engine answer nothing at all (as a SIGSTOPped process) until it is
cleared.

This module is the HTTP server; the KV it simulates is in ``stub_kv``, the answers' shapes in
``stub_shapes`` and the holding reports in ``stub_report``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from agentkv_server import wire
from agentkv_server.testing.stub_kv import (
    Retained,
    holding_params,
    prefill_params,
    prefix_hit,
    retention_s,
    take_retained,
)
from agentkv_server.testing.stub_report import Reporter, deliver, http_reporter
from agentkv_server.testing.stub_shapes import (
    MAX_TOKENS,
    answer_body,
    count_prompt_tokens,
    invalid_body,
    output_limit,
    stream_events,
    structured_answer,
    stub_answer,
)

__all__ = [
    "Fault",
    "RecordedRequest",
    "Reporter",
    "Retained",
    "StubCluster",
    "StubEngine",
    "count_prompt_tokens",
    "http_reporter",
    "stub_answer",
]

Fault = Literal["error", "bad_request", "disconnect", "hang"]
"""What the next completion request suffers: HTTP 500, HTTP 400, a dropped connection, or no
answer at all (until the client gives up)."""


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def kv_params(self) -> dict[str, Any]:
        return self.body.get(wire.KV_TRANSFER_PARAMS) or {}

    @property
    def is_prefill(self) -> bool:
        return bool(self.kv_params.get(wire.DO_REMOTE_DECODE))


@dataclass(eq=False)
class StubEngine:
    """One stub engine. Start it through :meth:`StubCluster.start`."""

    cluster: StubCluster
    name: str
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    healthy: bool = True
    record: bool = True  # keep every request in ``requests`` (off for long load runs)
    report_cached_tokens: bool = True
    delay_s: float = 0.0
    kv_load_fails: bool = False  # its reads of prefill engines' KV fail (it recomputes)
    one_prompt_at_a_time: bool = False  # prompts wait for the one computing, as on one core
    blocks_wait: tuple[float, float] | None = None  # each decode step's wait for blocks
    report_delay_s: float = 0.0  # a holding report reaches the router this long after the answer
    # The KV size its params report, as agentkv's connector does (None: reports none).
    kv_capacity_tokens: int | None = None
    kv_bytes_per_token: float | None = None
    host_tier_tokens: int | None = None  # a host tier below its KV cache, this many tokens
    requests: list[RecordedRequest] = field(default_factory=list)
    retained: dict[str, Retained] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    renewed: list[str] = field(default_factory=list)
    pulled: list[tuple[str, str, int]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    frozen: bool = False
    stall_after_chunks: int | None = None  # a stream stops (and hangs) after this many chunks
    freeze_after_chunks: int | None = None  # the engine freezes (as SIGSTOP) mid-stream
    # A stream's connection drops (as its process is killed) after this many chunks; with
    # ``cut_cleanly`` the stream ends properly there instead, without its last chunks.
    cut_after_chunks: int | None = None
    cut_cleanly: bool = False
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    kv_cache_usage: float = 0.0
    chunk_s: float = 0.02  # one engine step of a prompt being computed
    metrics_reads: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None
    _reports: set[asyncio.Task[None]] = field(default_factory=set)
    _computing: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    def completions(self) -> list[RecordedRequest]:
        """Recorded model calls (any endpoint), releases excluded."""
        return [
            r
            for r in self.requests
            if r.path.endswith(("completions", "responses"))
            and not wire.is_housekeeping(r.kv_params)
        ]

    async def start(self, port: int = 0) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/responses", self._completion)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop serving (the port closes; a cluster peer can no longer pull from it)."""
        await self.flush_reports()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def flush_reports(self) -> None:
        """Wait until every holding report this engine started has been delivered."""
        while self._reports:
            await asyncio.gather(*list(self._reports), return_exceptions=True)

    def _record(self, request: web.Request, body: dict[str, Any]) -> None:
        if self.record:
            self.requests.append(RecordedRequest(request.path, dict(request.headers), body))

    async def _thaw(self) -> None:
        while self.frozen:
            await asyncio.sleep(0.01)

    async def _health(self, _: web.Request) -> web.Response:
        await self._thaw()
        return web.json_response({}, status=200 if self.healthy else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        await self._thaw()
        self.metrics_reads += 1
        text = (
            f'vllm:prompt_tokens_total{{engine="0"}} {float(self.prompt_tokens_total)}\n'
            f'vllm:generation_tokens_total{{engine="0"}} {float(self.generation_tokens_total)}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv_cache_usage}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _models(self, _: web.Request) -> web.Response:
        await self._thaw()
        model = {"id": self.cluster.model, "object": "model", "owned_by": "agentkv-stub"}
        return web.json_response({"object": "list", "data": [model]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: the prompt's tokens as a completion would see them."""
        await self._thaw()
        body = await request.json()
        self._record(request, body)
        count = count_prompt_tokens(body)
        return web.json_response({"count": count, "max_model_len": MAX_TOKENS, "tokens": []})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        await self._thaw()
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "request body is not a JSON object")
        self._record(request, body)
        if (problem := invalid_body(body)) is not None:
            return _error(400, problem)
        if self.faults:
            faulted = await self._suffer(self.faults.pop(0), request)
            if faulted is not None:
                return faulted
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        params = body.get(wire.KV_TRANSFER_PARAMS) or {}
        if wire.RELEASE in params:
            self._release(params[wire.RELEASE])
        if wire.RENEW in params:
            self._renew(params[wire.RENEW])
        if wire.is_housekeeping(params):
            return web.json_response(answer_body(body, "", 1, 1, None))
        if params.get(wire.DO_REMOTE_DECODE):
            return await self._prefill(body, params)
        return await self._decode(request, body, params)

    async def _suffer(self, fault: Fault, request: web.Request) -> web.StreamResponse | None:
        if fault == "error":
            return _error(500, "injected engine failure")
        if fault == "bad_request":
            return _error(400, "injected bad request")
        if fault == "disconnect":
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        await asyncio.sleep(3600)  # "hang": the client's timeout ends it
        return None

    def _renew(self, renewals: dict[str, float]) -> None:
        for request_id, seconds in renewals.items():
            entry = self.retained.get(request_id)
            if entry is not None and entry.alive():
                entry.deadline = max(entry.deadline, time.monotonic() + seconds)
                self.renewed.append(request_id)

    def _release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.retained.pop(request_id, None) is not None:
                self.released.append(request_id)

    async def _compute(self, tokens: int) -> None:
        """Spend the time the cluster's model takes to prefill ``tokens``."""
        if not self.cluster.prefill_s_per_token or tokens <= 0:
            return
        computing = self._computing if self.one_prompt_at_a_time else contextlib.nullcontext()
        async with computing:
            loop = asyncio.get_running_loop()
            done_at = loop.time() + tokens * self.cluster.prefill_s_per_token
            while (left := done_at - loop.time()) > 0:  # chunk by chunk, each a step
                await asyncio.sleep(min(left, self.chunk_s))
                self.kv_cache_usage = (self.kv_cache_usage + 0.001) % 1.0

    async def _prefill(self, body: dict[str, Any], params: dict[str, Any]) -> web.Response:
        prompt_tokens = count_prompt_tokens(body)
        cached = min(self._pull(params), prompt_tokens)
        await self._compute(prompt_tokens - cached)
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += 1
        params = prefill_params(self.engine_id, self.port, prompt_tokens)
        cached_reported = cached if self.report_cached_tokens else None
        return web.json_response(
            answer_body(body, "tok", prompt_tokens, 1, cached_reported, params)
        )

    def _pull(self, params: dict[str, Any]) -> int:
        """Tokens pulled from the holder the params name; 0 (recompute) when it is gone."""
        holder = self.cluster.by_engine_id(params.get(wire.REMOTE_ENGINE_ID))
        request_id = params.get(wire.REMOTE_REQUEST_ID)
        if holder is None or not holder.running or not isinstance(request_id, str):
            return 0
        tokens = take_retained(holder.retained, request_id)
        if tokens:
            self.pulled.append((holder.engine_id, request_id, tokens))
        return tokens

    async def _decode(
        self, request: web.Request, body: dict[str, Any], params: dict[str, Any]
    ) -> web.StreamResponse:
        prompt_tokens = count_prompt_tokens(body)
        cached = 0
        load = self._load(params)
        if load is None:  # decode-only serving prefills locally
            cached = prefix_hit(self.retained, prompt_tokens)
            await self._compute(prompt_tokens - cached)
        elif load[wire.KV_LOAD] == wire.KV_LOAD_FAILED:
            await self._compute(prompt_tokens)  # kv_load_failure_policy: recompute
        n = output_limit(body)
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += n
        holding = self._retain(params, prompt_tokens + n)
        returned = holding if load is None else {**(holding or {}), **load}
        if self.blocks_wait is not None:
            waited, beside_retained = self.blocks_wait
            returned = {
                **(returned or {}),
                wire.WAITED_FOR_BLOCKS_SECONDS: waited,
                wire.WAITED_BESIDE_RETAINED_SECONDS: beside_retained,
            }
        ticket = params.get(wire.TICKET)
        if body.get("stream"):
            response = await self._stream(request, stream_events(body, n, prompt_tokens, returned))
        else:
            reported = cached if self.report_cached_tokens and cached else None
            structured = structured_answer(body)
            text = stub_answer(n) if structured is None else structured
            answer = answer_body(
                body, text, prompt_tokens, n, reported, returned, finished=structured is not None
            )
            response = web.json_response(answer)
        if ticket and returned is not None:
            self._report(wire.holding_report(ticket, returned))
        return response

    def _load(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """How the read of a prefill engine's KV went; None when the step reads none."""
        if not params.get(wire.DO_REMOTE_PREFILL):
            return None
        outcome = wire.KV_LOAD_FAILED if self.kv_load_fails else wire.KV_LOAD_OK
        return {wire.KV_LOAD: outcome, wire.KV_LOAD_FROM: params.get(wire.REMOTE_ENGINE_ID)}

    def _retain(self, params: dict[str, Any], num_tokens: int) -> dict[str, Any] | None:
        retention = retention_s(params)
        if retention <= 0:
            return None
        request_id = f"d-{uuid.uuid4().hex}"
        self.retained[request_id] = Retained(num_tokens, time.monotonic() + retention)
        hinted = wire.RETENTION_SECONDS in params
        return holding_params(
            self.engine_id,
            self.port,
            request_id,
            num_tokens,
            retention,
            hinted=hinted,
            capacity=self._capacity_params(),
        )

    def _capacity_params(self) -> dict[str, Any]:
        capacity: dict[str, Any] = {}
        if self.kv_capacity_tokens is not None:
            capacity[wire.KV_CACHE_TOKENS] = self.kv_capacity_tokens
        if self.kv_bytes_per_token is not None:
            capacity[wire.KV_BYTES_PER_TOKEN] = self.kv_bytes_per_token
        if self.host_tier_tokens is not None:
            capacity[wire.HOST_TIER_TOKENS] = self.host_tier_tokens
        return capacity

    async def _stream(self, request: web.Request, events: list[bytes]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for index, event in enumerate(events):
            if index == self.stall_after_chunks:
                await asyncio.sleep(3600)  # the client's deadline ends it
            if index == self.freeze_after_chunks:
                self.frozen = True  # nothing answers, health probes included
                await self._thaw()
            if index == self.cut_after_chunks:
                self.cut_after_chunks = None  # once: a continuation here is served whole
                if not self.cut_cleanly:
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                break
            await response.write(event)
        await response.write_eof()
        return response

    def _report(self, payload: dict[str, Any]) -> None:
        reporter = self.cluster.reporter
        if reporter is None:
            return
        task = asyncio.create_task(deliver(reporter, payload, self.report_delay_s))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)


class StubCluster:
    """Stub engines that can pull each other's retained KV, as NIXL peers would.

    ``prefill_s_per_token`` is the stub model's prefill cost (engines sleep for it); pulls are
    free, so with a cost the router's cost model has something to learn.
    """

    def __init__(
        self,
        *,
        model: str = "stub-model",
        reporter: Reporter | None = None,
        prefill_s_per_token: float = 0.0,
    ) -> None:
        self.model = model
        self.reporter = reporter
        self.prefill_s_per_token = prefill_s_per_token
        self.engines: list[StubEngine] = []
        self._names = itertools.count()

    async def start(self, name: str | None = None, **options: Any) -> StubEngine:
        engine = StubEngine(self, name or f"engine-{next(self._names)}", **options)
        await engine.start()
        self.engines.append(engine)
        return engine

    def by_engine_id(self, engine_id: object) -> StubEngine | None:
        return next((e for e in self.engines if e.engine_id == engine_id), None)

    async def flush_reports(self) -> None:
        await asyncio.gather(*(engine.flush_reports() for engine in self.engines))

    async def close(self) -> None:
        await asyncio.gather(*(engine.stop() for engine in self.engines))


def _error(status: int, message: str) -> web.Response:
    error = {
        "message": message,
        "type": "BadRequestError" if status < 500 else "InternalServerError",
        "param": None,
        "code": status,
    }
    return web.json_response({"error": error}, status=status)
