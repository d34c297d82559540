"""Runs points of planned sessions (the overload and ``agents12`` presets): per point, every
mode and repeat in turn, each on an empty stack and watched by the mode's router counts.

A run opens its mode, waits until the decode engines hold no earlier run's KV (as the pressure
sweep does: bench/pressure_run.py), reads the router's counts (bench/router_counts.py), sends
the point's sessions (bench/tenant_runner.py), reads the counts again and ends every session on
the router, which releases what it still holds for them. The point is the outer loop, so that
the modes of one point run close together in time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import httpx

from agentkv_server.bench.planned import Point
from agentkv_server.bench.pressure_run import drain, end_sessions
from agentkv_server.bench.records import RunWindow, SweepResult, TenantTurn
from agentkv_server.bench.router_counts import RouterCounts, scrape_router
from agentkv_server.bench.runner import Target
from agentkv_server.bench.tenant_runner import TenantRunner, session_id

__all__ = ["run_points"]

OpenTarget = Callable[[str], contextlib.AbstractAsyncContextManager[Target]]


async def run_points(
    points: Sequence[Point],
    modes: Sequence[str],
    repeats: int,
    open_target: OpenTarget,
    runner: TenantRunner,
    salt: str,
    *,
    progress: Callable[[str], None],
    secret: str | None = None,
    drain_max_s: float = 500.0,
) -> SweepResult:
    """Every point, mode and repeat once (the result's ``config`` is the caller's to fill).
    ``secret``: the routers' shared secret, for their ``/metrics`` once API keys are set."""
    turns: list[TenantTurn] = []
    windows: list[RunWindow] = []
    for point in points:
        for mode in modes:
            for repeat in range(repeats):
                ran, window = await _run(point, mode, repeat, open_target, runner, salt,
                                         secret, progress, drain_max_s)  # fmt: skip
                turns.extend(ran)
                windows.append(window)
                progress(_describe(window, ran))
    return SweepResult({}, tuple(turns), tuple(windows))


async def _run(
    point: Point,
    mode: str,
    repeat: int,
    open_target: OpenTarget,
    runner: TenantRunner,
    salt: str,
    secret: str | None,
    progress: Callable[[str], None],
    drain_max_s: float,
) -> tuple[list[TenantTurn], RunWindow]:
    async with open_target(mode) as target, httpx.AsyncClient() as http:
        drained = await drain(target.metrics_urls, http, drain_max_s, progress)
        router = target.base_urls[0] if target.tag_body else None
        before = await _counts(http, router, secret)
        started = time.monotonic()
        turns = await runner.run(
            target, point.sessions, salt=salt, repeat=repeat, tag=point.tag, load=point.load
        )
        duration = time.monotonic() - started
        counted = _growth(before, await _counts(http, router, secret))
        keys = {session_id(salt, mode, repeat, point.tag, s.key): s.api_key for s in point.sessions}
        await end_sessions(target, http, list(keys), keys)
    window = RunWindow(
        mode=mode,
        repeat=repeat,
        tag=point.tag,
        sessions=len(point.sessions),
        duration_s=round(duration, 1),
        drained_s=round(drained, 1),
        load=point.load,
        burst_size=point.burst_size,
        offered_tokens_per_s=point.offered_tokens_per_s,
        refused=counted.refused,
        queued=counted.queued,
        marked_down=counted.marked_down,
    )
    return turns, window


async def _counts(
    http: httpx.AsyncClient, router: str | None, secret: str | None
) -> RouterCounts | None:
    return None if router is None else await scrape_router(http, router, secret)


def _growth(before: RouterCounts | None, after: RouterCounts | None) -> RouterCounts:
    return RouterCounts() if before is None or after is None else after - before


def _describe(window: RunWindow, turns: list[TenantTurn]) -> str:
    outcomes = [t.outcome for t in turns]
    down = "n/a" if window.marked_down is None else f"{window.marked_down:g}"
    return (
        f"{window.tag}, {window.mode} {window.repeat + 1}: {len(turns)} turns of "
        f"{window.sessions} sessions in {window.duration_s:.0f} s: "
        f"{outcomes.count('served')} served, {outcomes.count('refused')} refused, "
        f"{outcomes.count('failed')} failed; engines marked down: {down}"
    )
