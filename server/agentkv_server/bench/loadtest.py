"""Router overhead benchmark: ``python -m agentkv_server.bench.loadtest``.

Measures, on loopback with stub engines (``python -m agentkv_server.testing``) in their own
process and the router (``agentkv router``) in another:

- ``engine``: a chat request sent straight to a stub engine (the baseline);
- ``router decode-only``: the same request through a router with no prefill engine (one hop);
- ``router P/D``: through a router with one prefill and one decode engine (two hops);
- ``router P/D + session``: the same with a session id per client, so every turn after the
  first pulls the previous turn's holding and records a new one.

Then the reuse decisions of the default (``agentkv``) policy on multi-turn sessions, over stub
engines whose model prefills at ``--prefill-us-per-token`` (pulls are free) and the default
cost-model priors: a long agent history and a short chat.

Latency percentiles at concurrency 1 and throughput at concurrency 1 and 32. The load generator
is Python (aiohttp, in this process): its own cost is in every row, so compare rows, not
absolute figures with a C load generator. Not a test: nothing here asserts a number.

With ``--sessions N`` it runs the session load instead: N agent sessions of ``--turns`` turns
at ``--concurrency`` (testing/workload.py: every answer checked), through a router whose index
is bounded at ``--max-sessions``, sampling the router's ``agentkv_sessions_held`` and resident
memory as it goes. Baseline: the same turns sent straight to the stubs, P step then D step, as
the router would, so that the difference is what the router adds. A second run gives the stub
model a prefill cost so that turns pull held KV (reuse) under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.testing.harness import conversation
from agentkv_server.testing.workload import Send, WorkloadReport, run_sessions

__all__ = ["LevelResult", "SessionLoadResult", "TurnRecord", "main"]

_BODY = {
    "model": "stub-model",
    "messages": [
        {"role": "system", "content": "You are a careful agent. " * 20},
        {"role": "user", "content": "List the files, then read the largest one."},
    ],
    "max_tokens": 4,
}


@dataclass(frozen=True)
class LevelResult:
    target: str
    concurrency: int
    requests: int
    errors: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float


async def drive(
    url: str, target: str, concurrency: int, total: int, *, sessions: bool = False
) -> LevelResult:
    """Send ``total`` requests from ``concurrency`` clients; latencies of the successful ones."""
    latencies: list[float] = []
    errors = 0
    issued = itertools.count()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def client(worker: int) -> None:
            nonlocal errors
            headers = {protocol.HEADER_SESSION_ID: f"bench-{worker}"} if sessions else {}
            while next(issued) < total:
                began = time.perf_counter()
                async with http.post(url, json=_BODY, headers=headers) as response:
                    await response.read()
                    ok = response.status == 200
                if ok:
                    latencies.append(time.perf_counter() - began)
                else:
                    errors += 1

        began = time.perf_counter()
        await asyncio.gather(*(client(worker) for worker in range(concurrency)))
        seconds = time.perf_counter() - began
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return LevelResult(
        target=target,
        concurrency=concurrency,
        requests=total,
        errors=errors,
        requests_per_s=total / seconds,
        p50_ms=quantiles[49] * 1000,
        p99_ms=quantiles[98] * 1000,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _process(argv: list[str], **kwargs) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(argv, text=True, **kwargs)
    try:
        yield process
    finally:
        process.terminate()
        process.wait(timeout=15)


async def _wait_healthy(url: str, deadline_s: float = 30.0) -> None:
    """Poll ``GET /health`` every 0.1 s until it answers 200."""
    polls = AsyncRetrying(
        stop=stop_after_delay(deadline_s),
        wait=wait_fixed(0.1),
        retry=retry_if_exception_type(aiohttp.ClientError) | retry_if_result(lambda s: s != 200),
    )
    async with aiohttp.ClientSession() as http:
        try:
            await polls(_health_status, http, url)
        except RetryError:
            raise RuntimeError(f"{url} did not become healthy") from None


async def _health_status(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/health") as response:
        return response.status


def _router_argv(port: int, secret: str, prefill: list[str], decode: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "agentkv_server.cli", "router", "--port", str(port)]
    argv += ["--secret", secret, "--decode-url", *decode, "--log-level", "warning"]
    return argv + (["--prefill-url", *prefill] if prefill else [])


async def _levels(url: str, target: str, args: argparse.Namespace, **kw) -> list[LevelResult]:
    await drive(url, target, 4, args.warmup, **kw)
    return [
        await drive(url, target, 1, args.requests, **kw),
        await drive(url, target, 32, args.requests * 4, **kw),
    ]


@dataclass(frozen=True)
class TurnRecord:
    session: str
    turn: int
    prompt_tokens: int
    path: str
    reused_tokens: int
    ms: float


async def multi_turn(router_url: str, sessions: dict[str, int], turns: int) -> list[TurnRecord]:
    """Drive each session (name -> words of system prompt) for ``turns`` turns."""
    records = []
    async with aiohttp.ClientSession() as http:
        for session, history in sessions.items():
            for turn in range(1, turns + 1):
                body = {**_BODY, "messages": conversation(turn, history)}
                began = time.perf_counter()
                async with http.post(
                    f"{router_url}/v1/chat/completions",
                    json=body,
                    headers={protocol.HEADER_SESSION_ID: session},
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


def _stub_argv(router_url: str, secret: str, *extra: str) -> list[str]:
    """Two stub engines (one P, one D) reporting holdings to ``router_url``."""
    return [
        sys.executable, "-m", "agentkv_server.testing", "--engines", "2",
        "--router-url", router_url, "--secret", secret, *extra,
    ]  # fmt: skip


async def decisions(args: argparse.Namespace) -> list[TurnRecord]:
    secret = secrets.token_urlsafe(16)
    port = _free_port()
    router_url = f"http://127.0.0.1:{port}"
    stub_argv = _stub_argv(
        router_url, secret, "--prefill-us-per-token", str(args.prefill_us_per_token)
    )
    with _process(stub_argv, stdout=subprocess.PIPE) as stubs:
        assert stubs.stdout is not None
        prefill_url, decode_url = json.loads(stubs.stdout.readline())
        with _process(_router_argv(port, secret, [prefill_url], [decode_url])):
            await _wait_healthy(router_url)
            return await multi_turn(router_url, {"agent-2k": 2000, "chat-40": 40}, turns=6)


async def run(args: argparse.Namespace) -> list[LevelResult]:
    secret = secrets.token_urlsafe(16)
    port = _free_port()
    router_url = f"http://127.0.0.1:{port}"
    path = "/v1/chat/completions"
    stub_argv = _stub_argv(router_url, secret)
    results: list[LevelResult] = []
    with _process(stub_argv, stdout=subprocess.PIPE) as stubs:
        assert stubs.stdout is not None
        prefill_url, decode_url = json.loads(stubs.stdout.readline())
        results += await _levels(decode_url + path, "engine", args)
        configurations = [
            ("router decode-only", [], [False]),
            ("router P/D", [prefill_url], [False, True]),
        ]
        for name, prefill, session_modes in configurations:
            with _process(_router_argv(port, secret, prefill, [decode_url])):
                await _wait_healthy(router_url)
                for sessions in session_modes:
                    target = name + (" + session" if sessions else "")
                    results += await _levels(router_url + path, target, args, sessions=sessions)
    return results


@dataclass(frozen=True)
class SessionLoadResult:
    target: str
    sent: int
    succeeded: int
    correct: int | None  # None: a baseline, whose answers are the engines' own
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    paths: dict[str, int]
    max_sessions_held: int | None = None
    rss_mib: tuple[float, float, float] | None = None  # router at start, peak, end


def _session_sender(http: aiohttp.ClientSession, router_url: str) -> Send:
    async def send(session: str, body: dict) -> tuple[int, dict[str, str], object]:
        async with http.post(
            f"{router_url}/v1/chat/completions",
            json=body,
            headers={protocol.HEADER_SESSION_ID: session},
        ) as response:
            answer = await response.json() if response.status == 200 else None
            return response.status, dict(response.headers), answer

    return send


def _direct_sender(http: aiohttp.ClientSession, prefill_url: str, decode_url: str) -> Send:
    """What the router does for a cold turn, without the router: P step, then D step."""
    path = "/v1/chat/completions"

    async def send(session: str, body: dict) -> tuple[int, dict[str, str], object]:
        prefill = {**body, "max_tokens": 1, wire.KV_TRANSFER_PARAMS: wire.cold_prefill_params()}
        async with http.post(prefill_url + path, json=prefill) as response:
            params = (await response.json())[wire.KV_TRANSFER_PARAMS]
        params = wire.decode_params(params, retention_s=0, ticket=None)
        decode = {**body, wire.KV_TRANSFER_PARAMS: params}
        async with http.post(decode_url + path, json=decode) as response:
            return response.status, dict(response.headers), await response.json()

    return send


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _sessions_held(http: aiohttp.ClientSession, router_url: str) -> int:
    async with http.get(f"{router_url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith("agentkv_sessions_held "):
                return int(float(line.split()[1]))
    return 0


def _summary(
    target: str, report: WorkloadReport, *, checked: bool, **extra: object
) -> SessionLoadResult:
    return SessionLoadResult(
        target=target,
        sent=report.sent,
        succeeded=report.succeeded,
        correct=report.correct if checked else None,
        requests_per_s=report.sent / report.seconds,
        p50_ms=report.percentile_ms(50),
        p99_ms=report.percentile_ms(99),
        paths={str(path): count for path, count in report.paths().items()},
        **extra,  # type: ignore[arg-type]
    )


async def session_load(args: argparse.Namespace, prefill_us: float) -> list[SessionLoadResult]:
    """The session load through a router (and, with free prefill, straight to the stubs)."""
    secret = secrets.token_urlsafe(16)
    port = _free_port()
    router_url = f"http://127.0.0.1:{port}"
    stub_argv = [sys.executable, "-m", "agentkv_server.testing", "--engines", "2"]
    stub_argv += ["--router-url", router_url, "--secret", secret]
    stub_argv += ["--prefill-us-per-token", str(prefill_us)]
    load = {"sessions": args.sessions, "turns": args.turns, "concurrency": args.concurrency}
    label = f"prefill {prefill_us:g} us/token"
    results = []
    connector = aiohttp.TCPConnector(limit=args.concurrency + 2)
    with _process(stub_argv, stdout=subprocess.PIPE) as stubs:
        assert stubs.stdout is not None
        prefill_url, decode_url = json.loads(stubs.stdout.readline())
        async with aiohttp.ClientSession(connector=connector) as http:
            if not prefill_us:
                direct = await run_sessions(_direct_sender(http, prefill_url, decode_url), **load)
                results.append(_summary(f"direct P+D, {label}", direct, checked=False))
            argv = _router_argv(port, secret, [prefill_url], [decode_url])
            argv += ["--max-sessions", str(args.max_sessions)]
            with _process(argv) as router:
                await _wait_healthy(router_url)
                send = _session_sender(http, router_url)
                await run_sessions(send, sessions=8, turns=2, concurrency=4)  # warm-up
                rss = [_rss_mib(router.pid)]
                held = [0]
                done = asyncio.Event()

                async def sample() -> None:
                    while not done.is_set():
                        held.append(await _sessions_held(http, router_url))
                        rss.append(_rss_mib(router.pid))
                        await asyncio.sleep(0.1)

                sampler = asyncio.create_task(sample())
                report = await run_sessions(send, **load)
                done.set()
                await sampler
                held.append(await _sessions_held(http, router_url))
                rss.append(_rss_mib(router.pid))
    results.append(
        _summary(
            f"router, {label}",
            report,
            checked=True,
            max_sessions_held=max(held),
            rss_mib=(rss[0], max(rss), rss[-1]),
        )
    )
    return results


def _session_table(results: list[SessionLoadResult], args: argparse.Namespace) -> str:
    header = (
        "| target | sent | ok | correct | req/s | p50 ms | p99 ms | kv paths | "
        f"max held (bound {args.max_sessions}) | router RSS MiB start/peak/end |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r.paths.items()) if k != "None") or "-"
        rss = "/".join(f"{m:.0f}" for m in r.rss_mib) if r.rss_mib else "-"
        lines.append(
            f"| {r.target} | {r.sent} | {r.succeeded} | {'-' if r.correct is None else r.correct}"
            f" | {r.requests_per_s:.0f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | {paths} | "
            f"{'-' if r.max_sessions_held is None else r.max_sessions_held} | {rss} |"
        )
    direct, routed = results[0], results[1]
    lines.append(
        f"\nWith free prefill, the router adds {routed.p50_ms - direct.p50_ms:.1f} ms p50 and "
        f"{routed.p99_ms - direct.p99_ms:.1f} ms p99 per turn at concurrency {args.concurrency}."
    )
    return "\n".join(lines)


def _table(results: list[LevelResult]) -> str:
    lines = [
        "| target | concurrency | req/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.target} | {r.concurrency} | {r.requests_per_s:.0f} | {r.p50_ms:.2f} | "
        f"{r.p99_ms:.2f} | {r.errors} |"
        for r in results
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentkv_server.bench.loadtest")
    parser.add_argument("--requests", type=int, default=1000, help="per level at concurrency 1")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=200.0,
        help="the stub model's prefill cost for the multi-turn decisions",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--sessions", type=int, help="run the session load with this many")
    parser.add_argument("--turns", type=int, default=5, help="per session (session load)")
    parser.add_argument("--concurrency", type=int, default=32, help="(session load)")
    parser.add_argument(
        "--max-sessions", type=int, default=64, help="the router's index bound (session load)"
    )
    args = parser.parse_args(argv)
    if args.sessions:
        return _main_sessions(args)
    results = asyncio.run(run(args))
    turns = asyncio.run(decisions(args))
    print(_table(results))
    baseline = {r.concurrency: r for r in results if r.target == "engine"}
    for r in results:
        if r.target != "engine" and r.concurrency == 1:
            base = baseline[1]
            print(
                f"{r.target}: adds {r.p50_ms - base.p50_ms:.2f} ms p50, "
                f"{r.p99_ms - base.p99_ms:.2f} ms p99 at concurrency 1"
            )
    print(
        "\n| session | turn | prompt tokens | path | reused tokens | ms |\n|---|---|---|---|---|---|"
    )
    for t in turns:
        print(
            f"| {t.session} | {t.turn} | {t.prompt_tokens} | {t.path} | {t.reused_tokens} | "
            f"{t.ms:.1f} |"
        )
    if args.out:
        with open(args.out, "w") as out:
            json.dump(
                {"levels": [asdict(r) for r in results], "turns": [asdict(t) for t in turns]},
                out,
                indent=2,
            )
    return 0


def _main_sessions(args: argparse.Namespace) -> int:
    results = asyncio.run(session_load(args, prefill_us=0.0))
    results += asyncio.run(session_load(args, prefill_us=args.prefill_us_per_token))
    print(_session_table(results, args))
    if args.out:
        with open(args.out, "w") as out:
            json.dump([asdict(r) for r in results], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
