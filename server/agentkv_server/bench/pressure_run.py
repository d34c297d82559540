"""Runs the pressure sweep: per number of sessions, every mode (and repeat) in turn, each run
watched by the decode engines' metrics (bench/waits.py).

Every run starts on an empty decode engine. What a run's router knows it still holds (idle
sessions' last turns) is released at the run's end by ending each session
(``DELETE /v1/sessions/{id}``); what no router knows (``upstream`` learns no streamed turn's
holding, and the engines keep each for 480 s) is waited out before the next run, up to
``drain_max_s``. That wait is setup, never part of a measured turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from agentkv_server.bench.pressure import PressureWorkload
from agentkv_server.bench.pressure_report import reused_history
from agentkv_server.bench.records import PressureWindow, TurnRecord
from agentkv_server.bench.runner import Runner, Target, session_name
from agentkv_server.bench.waits import (
    WAIT_THRESHOLD_S,
    EngineMemory,
    HoldingWaits,
    WaitWatch,
    waits_beside_holdings,
)

__all__ = ["DRAIN_FLOOR", "PressureRecords", "drain", "end_sessions", "run_pressure"]

# A decode engine holding at most this share of its KV cache counts as empty.
DRAIN_FLOOR = 0.02
_DRAIN_POLL_S = 2.0
_DRAIN_REPORT_S = 60.0

OpenTarget = Callable[[str], contextlib.AbstractAsyncContextManager[Target]]


@dataclass(frozen=True)
class PressureRecords:
    turns: list[TurnRecord]
    windows: list[PressureWindow]


async def run_pressure(
    workload: PressureWorkload,
    modes: Sequence[str],
    repeats: int,
    open_target: OpenTarget,
    runner: Runner,
    salt: str,
    *,
    progress: Callable[[str], None],
    drain_max_s: float = 500.0,
) -> PressureRecords:
    """Every sweep point, mode and repeat once; the sweep point is the outer loop, so that the
    modes of one point run close together in time."""
    records = PressureRecords([], [])
    for count in workload.session_counts:
        plans = workload.sessions(count)
        for mode in modes:
            for repeat in range(repeats):
                async with open_target(mode) as target, httpx.AsyncClient() as http:
                    drained = await drain(target.metrics_urls, http, drain_max_s, progress)
                    watch = WaitWatch(target.metrics_urls, http)
                    started = time.monotonic()
                    beside_before = await _beside_holdings(target, http)
                    async with watch.running():
                        turns = await runner.run_plans(target, repeat, salt, plans)
                    beside = _growth(beside_before, await _beside_holdings(target, http))
                    await end_sessions(target, http, [
                        session_name(salt, mode, repeat, plan, count) for plan in plans
                    ])  # fmt: skip
                window = _window(mode, repeat, count, watch, drained, beside)
                records.turns.extend(turns)
                records.windows.append(window)
                progress(_describe(window, turns, time.monotonic() - started))
    return records


async def drain(
    metrics_urls: Sequence[str],
    http: httpx.AsyncClient,
    max_s: float,
    progress: Callable[[str], None],
    *,
    poll_s: float = _DRAIN_POLL_S,
) -> float:
    """Wait until the decode engines hold at most ``DRAIN_FLOOR`` of their KV (or ``max_s``
    passed, or they do not say); returns the seconds waited."""
    watch = WaitWatch(metrics_urls, http)
    started = time.monotonic()
    said = started
    while True:
        held = _held_fraction(await watch.scrape())
        waited = time.monotonic() - started
        if held is None or held <= DRAIN_FLOOR or waited >= max_s:
            if waited >= 1.0:
                progress(f"decode KV down to {_pct(held)} after {waited:.0f} s")
            return waited
        if time.monotonic() - said >= _DRAIN_REPORT_S or said == started:
            progress(f"waiting for retained KV to leave the decode engine ({_pct(held)} held)")
            said = time.monotonic()
        await asyncio.sleep(poll_s)


async def end_sessions(
    target: Target,
    http: httpx.AsyncClient,
    session_ids: Sequence[str],
    api_keys: Mapping[str, str] | None = None,
) -> None:
    """Release what a router still holds for the run's sessions (engines answer 404: fine).
    ``api_keys``: the key each session's client sent, where the router takes keys (a session
    belongs to its tenant, and only the tenant may end it)."""
    if not target.tag_body:  # plain engines: no router, nothing of theirs is retained
        return
    for session_id in session_ids:
        key = (api_keys or {}).get(session_id)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        with contextlib.suppress(httpx.HTTPError):
            url = f"{target.base_urls[0].rstrip('/')}/v1/sessions/{session_id}"
            await http.delete(url, headers=headers)


def _held_fraction(engines: list[EngineMemory]) -> float | None:
    fractions = [e.used_fraction for e in engines if e.used_fraction is not None]
    return max(fractions) if fractions else None


async def _beside_holdings(target: Target, http: httpx.AsyncClient) -> HoldingWaits | None:
    """What the mode's router counted so far (bench/waits.py); None for plain engines."""
    if not target.tag_body:
        return None
    return await waits_beside_holdings(http, target.base_urls[0])


def _growth(before: HoldingWaits | None, after: HoldingWaits | None) -> HoldingWaits | None:
    return None if before is None or after is None else after - before


def _window(
    mode: str,
    repeat: int,
    count: int,
    watch: WaitWatch,
    drained_s: float,
    beside_holdings: HoldingWaits | None,
) -> PressureWindow:
    seen = watch.result
    counters = seen.counters if seen is not None else None
    return PressureWindow(
        mode=mode,
        repeat=repeat,
        sessions=count,
        decode_requests=None if counters is None else round(counters.requests),
        waited_requests=None if counters is None else round(counters.waited),
        waited_beside_holdings=None if beside_holdings is None else beside_holdings.requests,
        waited_beside_holdings_s=(
            None if beside_holdings is None else round(beside_holdings.seconds, 3)
        ),
        preemptions=None if counters is None else round(counters.preemptions),
        peak_kv_tokens=seen.peak_tokens if seen else None,
        peak_kv_fraction=seen.peak_fraction if seen else None,
        capacity_tokens=seen.capacity_tokens if seen else None,
        block_size=seen.block_size if seen else None,
        wait_threshold_s=WAIT_THRESHOLD_S,
        drained_s=round(drained_s, 1),
    )


def _describe(window: PressureWindow, turns: list[TurnRecord], seconds: float) -> str:
    failed = sum(not t.ok for t in turns)
    followups = [t for t in turns if t.ok and t.turn > 1]
    reused = sum(1 for t in followups if reused_history(t))
    return (
        f"{window.sessions} sessions, {window.mode} {window.repeat + 1}: {len(turns)} turns in "
        f"{seconds:.0f} s, {reused} of {len(followups)} follow-ups reused, {failed} failed, "
        f"peak decode KV {_pct(window.peak_kv_fraction)}"
    )


def _pct(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.0f}%"
