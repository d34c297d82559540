"""What a run of the overload and ``agents12`` presets sends: planned sessions, and the points
(runs' worth of them) a sweep runs per mode. Plain values, so that the presets' workloads can
be defined without the machinery that sends them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from agentkv_server.bench.pressure import SessionPlan

__all__ = ["ANONYMOUS_KEY", "PlannedSession", "Point"]

# The key a client sends where the router takes none (any value is accepted then).
ANONYMOUS_KEY: Final = "agentkv-bench"


@dataclass(frozen=True)
class PlannedSession:
    """One session of a run: its plan (history, start, tool gaps, whether its last turn says
    it ends), its ``label`` (tenant or kind), a ``key`` that names it within the run, the API key
    its client sends and the burst it arrives in (None: not part of a burst)."""

    plan: SessionPlan
    label: str
    key: str
    api_key: str = ANONYMOUS_KEY
    burst: int | None = None


@dataclass(frozen=True)
class Point:
    """One point: its sessions, the ``tag`` that names it in session ids and records, and, for
    an offered load, the load (x capacity), sessions per burst and the tokens/s offered."""

    tag: str
    sessions: tuple[PlannedSession, ...]
    load: float | None = None
    burst_size: int | None = None
    offered_tokens_per_s: float | None = None
