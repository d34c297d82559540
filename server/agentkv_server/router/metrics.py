"""The router's Prometheus metrics. The names are fixed (dashboards and our checks read them):

- ``agentkv_turns_total{path="local|reuse|recompute|fallback"}``
- ``agentkv_reused_tokens_total``, ``agentkv_recomputed_tokens_total``
- ``agentkv_ttft_seconds{path}`` (histogram: request arrival to the first byte sent back)
- ``agentkv_sessions_held`` (gauge, refreshed from the session store at each scrape)
- ``agentkv_engine_errors_total{role="prefill|decode",kind}``
- ``agentkv_streams_resumed_total`` (broken decode streams continued on another engine)
- ``agentkv_store_up`` (gauge: 0 while the session store is out and turns recompute)
- ``agentkv_store_errors_total{op}`` (failed session-store calls, by operation)
- ``agentkv_pair_transfers_total{prefill,decode,outcome="ok|failed"}`` (KV loads between a pair
  of engines, as the engine that loaded reported them: pairs.py)
- ``agentkv_pair_healthy{prefill,decode}`` (gauge: 1 while the pair's last transfer worked)
- ``agentkv_kv_held_tokens{engine}``, ``agentkv_kv_held_bytes{engine}`` (gauges: KV retained
  for sessions on each decode engine), ``agentkv_kv_capacity_tokens{engine}``,
  ``agentkv_kv_budget_tokens{engine}`` (gauges, once the engine's capacity is known: capacity.py)
- ``agentkv_kv_releases_total{reason="pressure|live_turn|session_end|abandoned|expired"}``
- ``agentkv_reuse_lost_to_pressure_total``, ``agentkv_reuse_lost_to_pressure_tokens_total``
  (turns that found their session's holding released for pressure, and its tokens)
- ``agentkv_path_decisions_total{path,reason}`` (the policy's choice for each turn with a
  holding, and why: ``local_fastest``, ``stall_over_budget``, ``pull_cheaper``... policy.py)
- ``agentkv_local_added_itl_seconds`` (histogram: the inter-token delay each local turn on a busy
  holder was predicted to add to the holder's running sequences, per decode step)
- ``agentkv_engine_blocks_wait_seconds{role,beside="retained|running"}`` (histogram: how long
  engine requests waited for KV blocks before they were admitted, as the engines reported it;
  ``retained`` where holdings that had not been released were in the way: blockwaits.py)
- ``agentkv_prefill_queue_seconds{engine}`` (gauge, refreshed at each scrape: the service a
  prefill engine's steps in flight still need, and those the router holds back for it, as the
  router predicts it: queue.StepQueue)
- ``agentkv_local_slowed_gap_share{engine}`` (gauge, refreshed at each scrape: of the gaps of
  a decode engine's streams this router relays, its last 2000, the share that ran beside a
  local prefill: what ``local.max_slowed_share`` holds down, placement.StepTimes)
- ``agentkv_admission_refused_total{priority,tenant}`` (turns refused as they arrived, 503 with
  ``Retry-After``: admission.py), ``agentkv_admission_queued_total{priority,tenant}`` (turns the
  router held back for a busy prefill engine), ``agentkv_admission_wait_seconds{priority}``
  (histogram: each prefill step's wait in the router's queue, 0 when sent at once) and
  ``agentkv_admission_waiting{priority}`` (gauge, refreshed at each scrape: turns held now);
  ``priority`` is ``follow_up`` or ``new``, ``tenant`` the API key's id or ``anonymous``
- ``agentkv_engines_marked_down_total{role,kind}`` (engines that went from healthy to down, by
  the failure's kind, or ``health`` when their periodic probes failed)
- ``agentkv_turns_timed_out_total{phase="queue|prefill|decode"}`` (turns that reached
  ``timeouts.first_token_s`` before their first token, answered 504: no engine is blamed)
- ``agentkv_client_disconnects_total{phase="body|turn"}`` (clients that closed their
  connection before the router answered: while sending their body, or while their turn ran,
  which was then cancelled)

Each app owns a registry, so several routers (tests, replicas in one process) never collide.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentkv_server.router import blockwaits
from agentkv_server.router.failures import ErrorKind
from agentkv_server.router.turn import KVPath

__all__ = ["ANONYMOUS", "EngineKVFigures", "RouterMetrics"]

ANONYMOUS = "anonymous"
"""The ``tenant`` label of turns without an API key (a router configured with none)."""

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.5)


@dataclass(frozen=True)
class EngineKVFigures:
    """One decode engine's retained KV at a scrape; None where the engine's size is unknown."""

    url: str
    held_tokens: int
    held_bytes: float | None
    capacity_tokens: int | None
    budget_tokens: int | None


class RouterMetrics:
    """Counters the orchestrator updates and ``/metrics`` renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.turns = Counter(
            "agentkv_turns_total", "Turns served, by KV path.", ["path"], registry=self.registry
        )
        self.reused_tokens = Counter(
            "agentkv_reused_tokens_total",
            "Prompt tokens not computed again: pulled from a decode holder, or found in the "
            "holder's prefix cache by a local turn.",
            registry=self.registry,
        )
        self.recomputed_tokens = Counter(
            "agentkv_recomputed_tokens_total",
            "Prompt tokens prefill engines computed.",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "agentkv_ttft_seconds",
            "Request arrival to first byte returned, by KV path.",
            ["path"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.sessions_held = Gauge(
            "agentkv_sessions_held",
            "Sessions with KV held on a decode engine.",
            registry=self.registry,
        )
        self.engine_errors = Counter(
            "agentkv_engine_errors_total",
            "Failed engine steps, by role and kind.",
            ["role", "kind"],
            registry=self.registry,
        )
        self.streams_resumed = Counter(
            "agentkv_streams_resumed_total",
            "Decode streams that broke after their first chunk and were continued on another "
            "decode engine.",
            registry=self.registry,
        )
        self.store_up = Gauge(
            "agentkv_store_up",
            "1 while the session store answers; 0 while the router serves without it.",
            registry=self.registry,
        )
        self.store_errors = Counter(
            "agentkv_store_errors_total",
            "Failed session-store calls, by operation.",
            ["op"],
            registry=self.registry,
        )
        self.pair_transfers = Counter(
            "agentkv_pair_transfers_total",
            "KV loads between a prefill and a decode engine (either way), by how they ended "
            "as the engine that loaded reported them.",
            ["prefill", "decode", "outcome"],
            registry=self.registry,
        )
        self.pair_healthy = Gauge(
            "agentkv_pair_healthy",
            "1 while a prefill/decode pair's last KV transfer worked; 0 while P/D turns avoid "
            "the pair.",
            ["prefill", "decode"],
            registry=self.registry,
        )
        self.kv_held_tokens = Gauge(
            "agentkv_kv_held_tokens",
            "Tokens of KV retained for sessions' next turns, by decode engine.",
            ["engine"],
            registry=self.registry,
        )
        self.kv_held_bytes = Gauge(
            "agentkv_kv_held_bytes",
            "Bytes of KV retained for sessions' next turns, by decode engine (per worker).",
            ["engine"],
            registry=self.registry,
        )
        self.kv_capacity_tokens = Gauge(
            "agentkv_kv_capacity_tokens",
            "A decode engine's whole KV cache in tokens, as its connector reported it.",
            ["engine"],
            registry=self.registry,
        )
        self.kv_budget_tokens = Gauge(
            "agentkv_kv_budget_tokens",
            "Tokens of a decode engine's KV that retained holdings may occupy.",
            ["engine"],
            registry=self.registry,
        )
        self.kv_releases = Counter(
            "agentkv_kv_releases_total",
            "Holdings released or dropped before their turn came, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.reuse_lost_to_pressure = Counter(
            "agentkv_reuse_lost_to_pressure_total",
            "Turns whose session's holding had been released for pressure.",
            registry=self.registry,
        )
        self.reuse_lost_to_pressure_tokens = Counter(
            "agentkv_reuse_lost_to_pressure_tokens_total",
            "Held tokens those turns would have reused.",
            registry=self.registry,
        )
        self.path_decisions = Counter(
            "agentkv_path_decisions_total",
            "The policy's path for each turn with a holding, and the reason it gives.",
            ["path", "reason"],
            registry=self.registry,
        )
        self.blocks_wait = Histogram(
            blockwaits.METRIC,
            "Seconds engine requests waited for KV blocks before admission, as the engines "
            "reported it; beside=retained where unreleased holdings were in the way.",
            ["role", "beside"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.local_added_itl = Histogram(
            "agentkv_local_added_itl_seconds",
            "Inter-token delay a local turn on a busy holder was predicted to add to each of "
            "the holder's decode steps (its prefill slice).",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.prefill_queue = Gauge(
            "agentkv_prefill_queue_seconds",
            "Seconds of service a prefill engine's steps in flight still need, and those the "
            "router holds back for it, as predicted from the tokens each computes.",
            ["engine"],
            registry=self.registry,
        )
        self.local_slowed_gap_share = Gauge(
            "agentkv_local_slowed_gap_share",
            "Of a decode engine's recent stream gaps relayed here (its last 2000), the share "
            "that ran beside a local prefill.",
            ["engine"],
            registry=self.registry,
        )
        self.admission_refused = Counter(
            "agentkv_admission_refused_total",
            "Turns refused as they arrived (503 with Retry-After): their predicted wait for a "
            "prefill engine exceeded admission.max_wait_s.",
            ["priority", "tenant"],
            registry=self.registry,
        )
        self.admission_queued = Counter(
            "agentkv_admission_queued_total",
            "Turns the router held back while their prefill engine was busy.",
            ["priority", "tenant"],
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            "agentkv_admission_wait_seconds",
            "Seconds each prefill step waited in the router's queue (0: sent at once).",
            ["priority"],
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.admission_waiting = Gauge(
            "agentkv_admission_waiting",
            "Turns held back in the router's queue now.",
            ["priority"],
            registry=self.registry,
        )
        self.engines_marked_down = Counter(
            "agentkv_engines_marked_down_total",
            "Engines that went from healthy to down, by why (a failure's kind, or health: "
            "their periodic probes failed).",
            ["role", "kind"],
            registry=self.registry,
        )
        self.turns_timed_out = Counter(
            "agentkv_turns_timed_out_total",
            "Turns that reached timeouts.first_token_s before their first token (504), by the "
            "phase they were in.",
            ["phase"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "agentkv_client_disconnects_total",
            "Clients that closed their connection before the router answered, by phase: while "
            "sending their body, or while their turn ran (then cancelled).",
            ["phase"],
            registry=self.registry,
        )
        self._decisions: dict[tuple[KVPath, str], Counter] = {}
        # Each path's children, looked up once rather than per turn (a path's TTFT series
        # appears with its first turn, as before).
        self._turns_by_path = {path: self.turns.labels(path=path.value) for path in KVPath}
        self._ttft_by_path: dict[KVPath, Histogram] = {}
        # The same for each pair's children: every P/D turn reports its pair's transfer.
        self._pair_transfers: dict[tuple[str, str, str], Counter] = {}
        self._pair_healthy: dict[tuple[str, str], Gauge] = {}

    def record_turn(self, path: KVPath, ttft_s: float, reused: int, recomputed: int) -> None:
        self._turns_by_path[path].inc()
        ttft = self._ttft_by_path.get(path)
        if ttft is None:
            ttft = self._ttft_by_path[path] = self.ttft.labels(path=path.value)
        ttft.observe(ttft_s)
        if reused:  # adding 0 changes nothing, and each inc takes a lock
            self.reused_tokens.inc(reused)
        if recomputed:
            self.recomputed_tokens.inc(recomputed)

    def record_decision(self, path: KVPath, reason: str, added_itl_s: float | None) -> None:
        key = (path, reason)
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self.path_decisions.labels(
                path=path.value, reason=reason
            )
        child.inc()
        if added_itl_s:  # a local turn on a busy holder (0 on an idle one)
            self.local_added_itl.observe(added_itl_s)

    def record_engine_error(self, role: str, kind: ErrorKind) -> None:
        self.engine_errors.labels(role=role, kind=kind).inc()

    def record_refused(self, priority: str, tenant: str | None) -> None:
        self.admission_refused.labels(priority=priority, tenant=tenant or ANONYMOUS).inc()

    def record_admission_wait(self, priority: str, tenant: str | None, waited_s: float) -> None:
        """A prefill step sent after ``waited_s`` in the router's queue (0: at once)."""
        self.admission_wait.labels(priority=priority).observe(waited_s)
        if waited_s > 0:
            self.admission_queued.labels(priority=priority, tenant=tenant or ANONYMOUS).inc()

    def record_marked_down(self, role: str, kind: str) -> None:
        self.engines_marked_down.labels(role=role, kind=kind).inc()

    def record_turn_timed_out(self, phase: str) -> None:
        self.turns_timed_out.labels(phase=phase).inc()

    def record_client_disconnect(self, phase: str) -> None:
        self.client_disconnects.labels(phase=phase).inc()

    def record_stream_resumed(self) -> None:
        self.streams_resumed.inc()

    def record_pair_transfer(self, prefill: str, decode: str, outcome: str) -> None:
        key = (prefill, decode, outcome)
        child = self._pair_transfers.get(key)
        if child is None:
            child = self._pair_transfers[key] = self.pair_transfers.labels(
                prefill=prefill, decode=decode, outcome=outcome
            )
        child.inc()

    def set_pair_healthy(self, prefill: str, decode: str, healthy: bool) -> None:
        key = (prefill, decode)
        child = self._pair_healthy.get(key)
        if child is None:
            child = self._pair_healthy[key] = self.pair_healthy.labels(
                prefill=prefill, decode=decode
            )
        child.set(1 if healthy else 0)

    def record_blocks_wait(self, role: str, seconds: float, *, beside_retained: bool) -> None:
        beside = "retained" if beside_retained else "running"
        self.blocks_wait.labels(role=role, beside=beside).observe(seconds)

    def record_kv_release(self, reason: str) -> None:
        self.kv_releases.labels(reason=reason).inc()

    def record_reuse_lost_to_pressure(self, tokens: int) -> None:
        self.reuse_lost_to_pressure.inc()
        self.reuse_lost_to_pressure_tokens.inc(tokens)

    def render(
        self,
        sessions_held: int,
        engines_kv: Iterable[EngineKVFigures] = (),
        prefill_queues: Iterable[tuple[str, float]] = (),
        slowed_gap_shares: Iterable[tuple[str, float]] = (),
        admission_waiting: Iterable[tuple[str, int]] = (),
    ) -> bytes:
        self.sessions_held.set(sessions_held)
        for priority, count in admission_waiting:
            self.admission_waiting.labels(priority=priority).set(count)
        for url, seconds in prefill_queues:
            self.prefill_queue.labels(engine=url).set(seconds)
        for url, share in slowed_gap_shares:
            self.local_slowed_gap_share.labels(engine=url).set(share)
        for kv in engines_kv:
            self.kv_held_tokens.labels(engine=kv.url).set(kv.held_tokens)
            if kv.held_bytes is not None:
                self.kv_held_bytes.labels(engine=kv.url).set(kv.held_bytes)
            if kv.capacity_tokens is not None:
                self.kv_capacity_tokens.labels(engine=kv.url).set(kv.capacity_tokens)
            if kv.budget_tokens is not None:
                self.kv_budget_tokens.labels(engine=kv.url).set(kv.budget_tokens)
        return generate_latest(self.registry)
