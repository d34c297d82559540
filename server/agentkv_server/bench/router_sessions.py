"""``agentkv bench router --only decisions`` and ``--only sessions``: multi-turn sessions through
agentkv's router on stub engines, driven from Python (every answer is read).

decisions: the default (``agentkv``) policy's KV path per turn of a long agent history and a
short chat, the stubs prefilling at --prefill-us-per-token (pulls are free), default cost-model
priors.

sessions: --sessions agent sessions of --turns turns at each --concurrency (testing/workload.py:
every answer checked) through a router whose index is bounded at --max-sessions, sampling the
router's ``agentkv_sessions_held`` and resident memory as it goes. Baseline: the same turns sent
straight to the stubs, P step then D step, as the router would, so that the difference is what
the router adds. A second run gives the stub model a prefill cost, so that turns pull held KV
(reuse) under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.bench import processes
from agentkv_server.bench.router import MAX_TOKENS, MESSAGES, MODEL, PATH
from agentkv_server.testing.harness import conversation
from agentkv_server.testing.workload import Send, WorkloadReport, run_sessions

__all__ = [
    "SessionLoadResult",
    "TurnRecord",
    "decisions",
    "decisions_table",
    "session_loads",
    "session_table",
]

_BODY = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
# Session name -> words of system prompt.
_DECISION_SESSIONS = {"agent-2k": 2000, "chat-40": 40}
_DECISION_TURNS = 6


@dataclass(frozen=True)
class TurnRecord:
    session: str
    turn: int
    prompt_tokens: int
    path: str
    reused_tokens: int
    ms: float


@dataclass(frozen=True)
class SessionLoadResult:
    target: str
    concurrency: int
    sent: int
    succeeded: int
    correct: int | None  # None: a baseline, whose answers are the engines' own
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    paths: dict[str, int]
    max_sessions_held: int | None = None
    rss_mib: tuple[float, float, float] | None = None  # router at start, peak, end


def decisions(prefill_us_per_token: float, logs: Path) -> list[TurnRecord]:
    """Each decision session's turns through a router in front of a computing stub pair."""
    return asyncio.run(_decisions(prefill_us_per_token, logs))


async def _decisions(prefill_us_per_token: float, logs: Path) -> list[TurnRecord]:
    secret = processes.new_secret()
    port = processes.free_port()
    router_url = f"http://127.0.0.1:{port}"
    with processes.start_stubs(
        router_url,
        secret,
        logs / "decisions-stubs.log",
        prefill_us_per_token=prefill_us_per_token,
        record=True,
    ) as stubs:
        argv = processes.router_argv(port, secret, [stubs.prefill], [stubs.decode])
        with processes.process(argv, logs / "decisions-router.log") as router:
            processes.wait_healthy(router_url, router)
            return await multi_turn(router_url, _DECISION_SESSIONS, _DECISION_TURNS)


async def multi_turn(router_url: str, sessions: dict[str, int], turns: int) -> list[TurnRecord]:
    """Drive each session (name -> words of system prompt) for ``turns`` turns."""
    records = []
    async with aiohttp.ClientSession() as http:
        for session, history in sessions.items():
            for turn in range(1, turns + 1):
                body = {**_BODY, "messages": conversation(turn, history)}
                began = time.perf_counter()
                async with http.post(
                    router_url + PATH, json=body, headers={protocol.HEADER_SESSION_ID: session}
                ) as response:
                    answer = await response.json()
                records.append(
                    TurnRecord(
                        session,
                        turn,
                        answer["usage"]["prompt_tokens"],
                        response.headers[protocol.HEADER_KV_PATH],
                        int(response.headers[protocol.HEADER_REUSED_TOKENS]),
                        (time.perf_counter() - began) * 1000,
                    )
                )
    return records


def decisions_table(turns: list[TurnRecord]) -> str:
    lines = [
        "| session | turn | prompt tokens | path | reused tokens | ms |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {t.session} | {t.turn} | {t.prompt_tokens} | {t.path} | {t.reused_tokens} | "
        f"{t.ms:.1f} |"
        for t in turns
    ]
    return "\n".join(lines)


def session_loads(args: argparse.Namespace, logs: Path) -> list[SessionLoadResult]:
    """At each concurrency: free prefill (direct and through the router), then the prefill
    cost (through the router)."""
    results = []
    for concurrency in args.concurrency:
        for prefill_us in (0.0, args.prefill_us_per_token):
            results += asyncio.run(_session_load(args, concurrency, prefill_us, logs))
    return results


def _session_sender(http: aiohttp.ClientSession, router_url: str) -> Send:
    async def send(session: str, body: dict) -> tuple[int, dict[str, str], object]:
        async with http.post(
            router_url + PATH, json=body, headers={protocol.HEADER_SESSION_ID: session}
        ) as response:
            answer = await response.json() if response.status == 200 else None
            return response.status, dict(response.headers), answer

    return send


def _direct_sender(http: aiohttp.ClientSession, prefill_url: str, decode_url: str) -> Send:
    """What the router does for a cold turn, without the router: P step, then D step."""

    async def send(session: str, body: dict) -> tuple[int, dict[str, str], object]:
        prefill = {**body, "max_tokens": 1, wire.KV_TRANSFER_PARAMS: wire.cold_prefill_params()}
        async with http.post(prefill_url + PATH, json=prefill) as response:
            params = (await response.json())[wire.KV_TRANSFER_PARAMS]
        params = wire.decode_params(params, retention_s=0, ticket=None)
        decode = {**body, wire.KV_TRANSFER_PARAMS: params}
        async with http.post(decode_url + PATH, json=decode) as response:
            return response.status, dict(response.headers), await response.json()

    return send


async def _sessions_held(http: aiohttp.ClientSession, router_url: str) -> int:
    async with http.get(f"{router_url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith("agentkv_sessions_held "):
                return int(float(line.split()[1]))
    return 0


def _summary(
    target: str, concurrency: int, report: WorkloadReport, *, checked: bool, **extra: object
) -> SessionLoadResult:
    return SessionLoadResult(
        target=target,
        concurrency=concurrency,
        sent=report.sent,
        succeeded=report.succeeded,
        correct=report.correct if checked else None,
        requests_per_s=report.sent / report.seconds,
        p50_ms=report.percentile_ms(50),
        p99_ms=report.percentile_ms(99),
        paths={str(path): count for path, count in report.paths().items()},
        **extra,  # type: ignore[arg-type]
    )


async def _session_load(
    args: argparse.Namespace, concurrency: int, prefill_us: float, logs: Path
) -> list[SessionLoadResult]:
    """The session load through a router (and, with free prefill, straight to the stubs)."""
    secret = processes.new_secret()
    port = processes.free_port()
    router_url = f"http://127.0.0.1:{port}"
    load = {"sessions": args.sessions, "turns": args.turns, "concurrency": concurrency}
    label = f"prefill {prefill_us:g} us/token"
    name = f"sessions-c{concurrency}-p{prefill_us:g}"
    results = []
    connector = aiohttp.TCPConnector(limit=concurrency + 2)
    with processes.start_stubs(
        router_url, secret, logs / f"{name}-stubs.log", prefill_us_per_token=prefill_us, record=True
    ) as stubs:
        async with aiohttp.ClientSession(connector=connector) as http:
            if not prefill_us:
                direct = await run_sessions(
                    _direct_sender(http, stubs.prefill, stubs.decode), **load
                )
                results.append(_summary(f"direct P+D, {label}", concurrency, direct, checked=False))
            argv = processes.router_argv(
                port, secret, [stubs.prefill], [stubs.decode], max_sessions=args.max_sessions
            )
            with processes.process(argv, logs / f"{name}-router.log") as router:
                processes.wait_healthy(router_url, router)
                send = _session_sender(http, router_url)
                await run_sessions(send, sessions=8, turns=2, concurrency=4)  # warm-up
                rss = [processes.rss_mib(router.pid)]
                held = [0]
                done = asyncio.Event()

                async def sample() -> None:
                    while not done.is_set():
                        held.append(await _sessions_held(http, router_url))
                        rss.append(processes.rss_mib(router.pid))
                        await asyncio.sleep(0.1)

                sampler = asyncio.create_task(sample())
                report = await run_sessions(send, **load)
                done.set()
                await sampler
                held.append(await _sessions_held(http, router_url))
                rss.append(processes.rss_mib(router.pid))
    results.append(
        _summary(
            f"router, {label}",
            concurrency,
            report,
            checked=True,
            max_sessions_held=max(held),
            rss_mib=(rss[0], max(rss), rss[-1]),
        )
    )
    return results


def session_table(results: list[SessionLoadResult], max_sessions: int) -> str:
    header = (
        "| target | c | sent | ok | correct | req/s | p50 ms | p99 ms | kv paths | "
        f"max held (bound {max_sessions}) | router RSS MiB start/peak/end |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r.paths.items()) if k != "None") or "-"
        rss = "/".join(f"{m:.0f}" for m in r.rss_mib) if r.rss_mib else "-"
        lines.append(
            f"| {r.target} | {r.concurrency} | {r.sent} | {r.succeeded} | "
            f"{'-' if r.correct is None else r.correct} | {r.requests_per_s:.0f} | "
            f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {paths} | "
            f"{'-' if r.max_sessions_held is None else r.max_sessions_held} | {rss} |"
        )
    lines.append("")
    for direct in (r for r in results if r.correct is None):
        routed = next(
            r for r in results if r.concurrency == direct.concurrency and r.correct is not None
        )
        lines.append(
            f"With free prefill, the router adds {routed.p50_ms - direct.p50_ms:.1f} ms p50 and "
            f"{routed.p99_ms - direct.p99_ms:.1f} ms p99 per turn at concurrency "
            f"{direct.concurrency}."
        )
    return "\n".join(lines)
