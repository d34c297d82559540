"""Figures of a set of turns sent as agents' clients send them (bench/tenant_runner.py), shared
by the overload and ``agents12`` reports: outcomes, follow-up TTFT, reuse, end-to-end times.

Percentiles are nearest-rank over the turns pooled (repeats together): every figure is a value
that was measured, and a p99 over fewer than a hundred turns is their slowest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from agentkv_server.bench.pressure_report import reused_history
from agentkv_server.bench.records import TenantTurn, TurnRecord
from agentkv_server.bench.stats import percentile

__all__ = ["REUSE_PATHS", "TurnFigures", "quantile", "reused"]

# The router's KV paths that serve a follow-up from its held history.
REUSE_PATHS: Final = frozenset({"local", "reuse"})


def reused(record: TurnRecord) -> bool:
    """Whether a follow-up was served from its session's held history: by the router's KV path
    where a router said one, else (no router) by the engine's prefix-cache hits."""
    if record.kv_path is not None:
        return record.kv_path in REUSE_PATHS
    return reused_history(record)


def quantile(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


@dataclass(frozen=True)
class TurnFigures:
    """Turns sent, and of them served, refused at arrival (every try), failed after being
    accepted and retried (more than one try); follow-ups served, those that reused their
    history, their TTFT p50/p99; end-to-end times of the turns served."""

    turns: int
    served: int
    refused: int
    failed: int
    retried: int
    followups: int
    reused: int
    followup_p50_s: float | None
    followup_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    e2e_max_s: float | None

    @property
    def reuse_share(self) -> float | None:
        return self.reused / self.followups if self.followups else None

    @classmethod
    def of(cls, turns: Iterable[TenantTurn]) -> TurnFigures:
        turns = list(turns)
        outcomes = [t.outcome for t in turns]
        served = [t.turn for t in turns if t.outcome == "served"]
        followups = [r for r in served if r.turn > 1]
        ttfts = [r.ttft_s for r in followups if r.ttft_s is not None]
        e2e = [r.latency_s for r in served if r.latency_s is not None]
        return cls(
            turns=len(turns),
            served=len(served),
            refused=outcomes.count("refused"),
            failed=outcomes.count("failed"),
            retried=sum(len(t.attempts) > 1 for t in turns),
            followups=len(followups),
            reused=sum(reused(r) for r in followups),
            followup_p50_s=quantile(ttfts, 50),
            followup_p99_s=quantile(ttfts, 99),
            e2e_p50_s=quantile(e2e, 50),
            e2e_p99_s=quantile(e2e, 99),
            e2e_max_s=max(e2e, default=None),
        )
