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

Each app owns a registry, so several routers (tests, replicas in one process) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentkv_server.router.failures import ErrorKind
from agentkv_server.router.turn import KVPath

__all__ = ["RouterMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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
        # Each path's children, looked up once rather than per turn (a path's TTFT series
        # appears with its first turn, as before).
        self._turns_by_path = {path: self.turns.labels(path=path.value) for path in KVPath}
        self._ttft_by_path: dict[KVPath, Histogram] = {}

    def record_turn(self, path: KVPath, ttft_s: float, reused: int, recomputed: int) -> None:
        self._turns_by_path[path].inc()
        ttft = self._ttft_by_path.get(path)
        if ttft is None:
            ttft = self._ttft_by_path[path] = self.ttft.labels(path=path.value)
        ttft.observe(ttft_s)
        self.reused_tokens.inc(reused)
        self.recomputed_tokens.inc(recomputed)

    def record_engine_error(self, role: str, kind: ErrorKind) -> None:
        self.engine_errors.labels(role=role, kind=kind).inc()

    def record_stream_resumed(self) -> None:
        self.streams_resumed.inc()

    def record_pair_transfer(self, prefill: str, decode: str, outcome: str) -> None:
        self.pair_transfers.labels(prefill=prefill, decode=decode, outcome=outcome).inc()

    def set_pair_healthy(self, prefill: str, decode: str, healthy: bool) -> None:
        self.pair_healthy.labels(prefill=prefill, decode=decode).set(1 if healthy else 0)

    def render(self, sessions_held: int) -> bytes:
        self.sessions_held.set(sessions_held)
        return generate_latest(self.registry)
