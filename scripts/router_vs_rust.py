#!/usr/bin/env python
"""agentkv's router beside vllm-router (Rust, ``--vllm-pd-disaggregation``) on the same stub engines.

Each configuration gets a new stub prefill engine and stub decode engine (``python -m
agentkv_server.testing``, one process, so that the prefill stub can pull what the decode stub
holds; holding reports go to agentkv's router as a real decode engine sends them),
then drives each target with wrk (one thread, closed loop: every connection sends its next
request when the last one is answered) for ``--duration`` seconds per row, after a short warm-up:

- ``stub D step``: the decode step's request sent straight to the decode stub (the baseline: what
  one engine hop costs without any router);
- ``vllm-router P/D``: ``vllm-router --vllm-pd-disaggregation`` with the two stubs;
- ``agentkv P/D``: ``agentkv router`` with the two stubs, no session id;
- ``agentkv P/D + session``: the same with an ``x-session-id`` per connection (each turn takes the
  session's holding, issues a ticket, records the new holding, releases the old one);
- ``agentkv P/D + session, Redis, 1 replica`` and ``..., 2 replicas``: one, then two ``agentkv
  router`` processes on a Redis store (``--replicas 2``; needs redis-server), each driven by
  its own wrk with its share of the connections.

Each at concurrency 1 and 32, non-streamed and streamed. The table has req/s, p50 and p99 (wrk's
latency: request written to response complete), the p50 added over the direct stub step, and the
router processes' and the stubs' CPU per request (user + system time over the row / requests:
less sensitive to a busy machine than the rates, and where a turn's work goes). All processes
share the machine's cores: on a small machine the router, the stubs and wrk compete, so the
same run measures every router under the same conditions. Not a test: nothing here asserts.

Prerequisites: ``wrk`` (apt-get install wrk) and ``vllm-router`` (pip install vllm-router) on
PATH or given by ``--wrk`` / ``--vllm-router``; ``py-spy`` for ``--profile``.

    .venv/bin/python scripts/router_vs_rust.py                       # every row, 10 s each
    .venv/bin/python scripts/router_vs_rust.py --only agentkv --concurrency 32 --duration 5
    .venv/bin/python scripts/router_vs_rust.py --profile /tmp/prof   # py-spy of agentkv at c=32
    .venv/bin/python scripts/router_vs_rust.py --baseline /tmp/before # and an older checkout
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from subprocess import PIPE

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.testing.redis_server import RedisServer

PATH = "/v1/chat/completions"
MODEL = "stub-model"
MESSAGES = [
    {"role": "system", "content": "You are a careful agent. " * 20},
    {"role": "user", "content": "List the files, then read the largest one."},
]
MAX_TOKENS = 4
# What the decode stub sees in a P/D turn: the prefill step's params, nothing retained after.
DIRECT_PARAMS = wire.decode_params(
    {
        wire.DO_REMOTE_PREFILL: True,
        wire.DO_REMOTE_DECODE: False,
        wire.REMOTE_ENGINE_ID: "direct",
        wire.REMOTE_REQUEST_ID: "direct",
        wire.REMOTE_BLOCK_IDS: [0],
        wire.REMOTE_HOST: "127.0.0.1",
        wire.REMOTE_PORT: 1,
    },
    retention_s=0,
    ticket=None,
)

# wrk's script: POST the body given as the first script argument; with a second argument N > 0
# every request carries the session header named by the third, "bench-<run>-<thread>-<i>" (run:
# the fourth argument, one per wrk process), i cycling over N ids (one per connection at
# closed-loop concurrency N): a session's turns mostly follow each other.
# done() prints one JSON line the script reads.
WRK_SCRIPT = r"""
local threads = {}
function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end
function init(args)
  body = args[1]
  sessions = tonumber(args[2] or "0")
  session_header = args[3]
  run = args[4] or "0"
  counter = 0
end
function request()
  local headers = {["Content-Type"] = "application/json"}
  if sessions > 0 then
    counter = counter + 1
    headers[session_header] = "bench-" .. run .. "-" .. tid .. "-" .. (counter % sessions)
  end
  return wrk.format("POST", nil, headers, body)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\nWRK-JSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"errors":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status + e.timeout + e.connect + e.read + e.write))
end
"""


@dataclass(frozen=True)
class Row:
    target: str
    stream: bool
    concurrency: int
    requests: int
    errors: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float | None  # the router processes' CPU; None for the direct row
    stub_cpu_us_per_request: float  # the stub engines' process
    paths: dict[str, int]  # agentkv's turns by KV path during the row (its /metrics)


@dataclass(frozen=True)
class Stubs:
    prefill: str
    decode: str
    pid: int


@dataclass
class Target:
    name: str
    urls: list[str]  # one per wrk process (a replica each)
    pids: list[int]  # processes whose CPU counts as the router's
    stub_pid: int
    sessions: bool = False
    agentkv: bool = False  # has agentkv's /metrics


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def process(argv: list[str], log: Path, **kwargs: object) -> Iterator[subprocess.Popen[str]]:
    with open(log, "w") as out:
        kwargs.setdefault("stdout", out)
        proc = subprocess.Popen(argv, text=True, stderr=out, **kwargs)  # type: ignore[call-overload]
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[str], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} ({url})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def turn_paths(target: Target) -> dict[str, int]:
    """agentkv's ``agentkv_turns_total`` by path, summed over the target's replicas."""
    paths: dict[str, int] = {}
    for url in target.urls if target.agentkv else []:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            if line.startswith('agentkv_turns_total{path="'):
                path = line.split('"')[1]
                paths[path] = paths.get(path, 0) + int(float(line.rsplit(" ", 1)[1]))
    return paths


def request_body(stream: bool, direct: bool) -> str:
    body: dict[str, object] = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    if stream:
        body["stream"] = True
    if direct:
        body[wire.KV_TRANSFER_PARAMS] = DIRECT_PARAMS
    return json.dumps(body)


def run_wrk(
    args: argparse.Namespace,
    url: str,
    body: str,
    connections: int,
    sessions: int,
    seconds: float,
    run: int = 0,
) -> subprocess.Popen[str]:
    argv = [args.wrk, "-t1", f"-c{connections}", f"-d{max(round(seconds), 1)}s", "--timeout", "5s"]
    argv += ["-s", str(args.wrk_script), url + PATH, "--", body, str(sessions)]
    argv += [protocol.HEADER_SESSION_ID, str(run)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wrk_result(proc: subprocess.Popen[str]) -> dict[str, int]:
    out, _ = proc.communicate()
    for line in out.splitlines():
        if line.startswith("WRK-JSON "):
            return json.loads(line[len("WRK-JSON ") :])
    raise RuntimeError(f"wrk printed no result:\n{out}")


def measure(args: argparse.Namespace, target: Target, stream: bool, concurrency: int) -> Row:
    body = request_body(stream, direct=not target.pids)
    per = max(concurrency // len(target.urls), 1)
    sessions = per if target.sessions else 0
    warm = [
        run_wrk(args, url, body, per, sessions, args.warmup, run)
        for run, url in enumerate(target.urls)
    ]
    for proc in warm:
        wrk_result(proc)
    cpu_before, paths_before = cpu_seconds(target.pids), turn_paths(target)
    stub_before = cpu_seconds([target.stub_pid])
    procs = [
        run_wrk(args, url, body, per, sessions, args.duration, run)
        for run, url in enumerate(target.urls)
    ]
    results = [wrk_result(proc) for proc in procs]
    cpu = cpu_seconds(target.pids) - cpu_before
    stub_cpu = cpu_seconds([target.stub_pid]) - stub_before
    paths = {k: v - paths_before.get(k, 0) for k, v in turn_paths(target).items()}
    requests = sum(r["requests"] for r in results)
    seconds = max(r["duration_us"] for r in results) / 1e6
    return Row(
        target=target.name,
        stream=stream,
        concurrency=per * len(target.urls),
        requests=requests,
        errors=sum(r["errors"] for r in results),
        requests_per_s=requests / seconds,
        # Replicas: the worse of the wrk processes' percentiles (each saw half the load).
        p50_ms=max(r["p50_us"] for r in results) / 1000,
        p99_ms=max(r["p99_us"] for r in results) / 1000,
        cpu_us_per_request=cpu / requests * 1e6 if target.pids and requests else None,
        stub_cpu_us_per_request=stub_cpu / max(requests, 1) * 1e6,
        paths={path: count for path, count in paths.items() if count},
    )


def agentkv_argv(port: int, secret: str, stubs: Stubs, redis: str | None) -> list[str]:
    argv = [sys.executable, "-m", "agentkv_server.cli", "router", "--port", str(port)]
    argv += ["--secret", secret, "--prefill-url", stubs.prefill, "--decode-url", stubs.decode]
    argv += ["--log-level", "warning"]
    return argv + (["--redis-url", redis] if redis else [])


def vllm_router_argv(binary: str, port: int, stubs: Stubs) -> list[str]:
    argv = [binary, "--vllm-pd-disaggregation", "--prefill", stubs.prefill]
    argv += ["--decode", stubs.decode]
    return argv + ["--port", str(port), "--policy", "round_robin", "--log-level", "warning"]


def stub_argv(router_url: str, secret: str) -> list[str]:
    # One process: the prefill stub pulls held KV from the decode stub in memory.
    argv = [sys.executable, "-m", "agentkv_server.testing", "--engines", "2", "--no-record"]
    return argv + ["--router-url", router_url, "--secret", secret]


def profile(args: argparse.Namespace, target: Target, stream: bool) -> None:
    """py-spy over the router while wrk drives it at concurrency 32: a flamegraph and a
    collapsed-stack file (one line per stack, with its sample count) per mode."""
    args.profile.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in target.name.lower())
    name = f"{slug}-{'stream' if stream else 'json'}"
    body = request_body(stream, direct=False)
    seconds = args.duration
    load = run_wrk(args, target.urls[0], body, 32, 32 if target.sessions else 0, seconds + 2)
    time.sleep(1)
    for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
        subprocess.run(
            [args.py_spy, "record", "--nonblocking", "-p", str(target.pids[0]), "-r", "250"]
            + ["-d", str(max(int(seconds / 2), 1)), "-f", fmt]
            + ["-o", str(args.profile / f"{name}.{suffix}")],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    wrk_result(load)
    print(f"profile: {args.profile}/{name}.svg, .txt")


def run(args: argparse.Namespace) -> list[Row]:
    secret = secrets.token_hex(16)  # not token_urlsafe: one starting with "-" reads as an option
    ports = [free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    logs = Path(tempfile.mkdtemp(prefix="router-vs-rust-"))
    rows: list[Row] = []

    def start_stubs(stack: contextlib.ExitStack) -> Stubs:
        """New stubs per configuration: the decode stub retains what each router asks it to
        keep (vllm-router: upstream's 480 s for every request), and that must not weigh on
        the next configuration."""
        argv = stub_argv(urls[0], secret)
        proc = stack.enter_context(process(argv, logs / f"stubs-{len(rows)}.log", stdout=PIPE))
        assert proc.stdout is not None
        prefill, decode = json.loads(proc.stdout.readline())
        return Stubs(prefill, decode, proc.pid)

    def agentkv(
        stack: contextlib.ExitStack,
        name: str,
        sessions: bool,
        redis: str | None,
        count: int,
        source: Path | None = None,
    ) -> Target:
        stubs = start_stubs(stack)
        env = dict(os.environ)
        if source is not None:  # another checkout's router (sdk, server, integrations)
            tree = [str(source / part) for part in ("sdk", "server", "integrations")]
            env["PYTHONPATH"] = os.pathsep.join(tree)
        argv = [agentkv_argv(port, secret, stubs, redis) for port in ports[:count]]
        procs = [
            stack.enter_context(process(a, logs / f"agentkv-{i}-{len(rows)}.log", env=env))
            for i, a in enumerate(argv)
        ]
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc)
        pids = [proc.pid for proc in procs]
        return Target(name, urls[:count], pids, stubs.pid, sessions, agentkv=True)

    def measure_all(target: Target) -> None:
        for stream in args.stream:
            if args.profile is not None and target.agentkv:
                profile(args, target, stream)
            for concurrency in args.concurrency:
                row = measure(args, target, stream, concurrency)
                rows.append(row)
                print(format_row(row, rows), flush=True)

    if "direct" in args.only:
        with contextlib.ExitStack() as stack:
            stubs = start_stubs(stack)
            measure_all(Target("stub D step", [stubs.decode], [], stubs.pid))
    if "rust" in args.only:
        with contextlib.ExitStack() as stack:
            stubs = start_stubs(stack)
            port = free_port()
            argv = vllm_router_argv(args.vllm_router, port, stubs)
            rust = stack.enter_context(process(argv, logs / "vllm-router.log"))
            wait_healthy(f"http://127.0.0.1:{port}", rust)
            url = f"http://127.0.0.1:{port}"
            measure_all(Target("vllm-router P/D", [url], [rust.pid], stubs.pid))
    if "agentkv" in args.only:
        sources = [(None, "")] + [(src, f" [{src.name}]") for src in args.baseline]
        for source, label in sources:
            for sessions in (False, True):
                name = f"agentkv P/D{' + session' if sessions else ''}{label}"
                with contextlib.ExitStack() as stack:
                    measure_all(agentkv(stack, name, sessions, None, 1, source))
    if "replicas" in args.only and args.replicas > 1:
        # One process on the same Redis first: what the shared store costs, apart from what
        # more processes add.
        for count in (1, args.replicas):
            with contextlib.ExitStack() as stack:
                redis = stack.enter_context(RedisServer())
                name = f"agentkv P/D + session, Redis, {count} replica{'s' if count > 1 else ''}"
                measure_all(agentkv(stack, name, True, redis.url, count))
    print(f"logs: {logs}")
    return rows


HEADER = (
    "| target | stream | c | req/s | p50 ms | p99 ms | +p50 ms vs stub | router CPU us/req | "
    "stubs CPU us/req | errors | agentkv paths |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: Row, rows: list[Row]) -> str:
    base = next(
        (
            r
            for r in rows
            if not r.cpu_us_per_request
            and r.stream == row.stream
            and r.concurrency == row.concurrency
            and r.target == "stub D step"
        ),
        None,
    )
    added = f"{row.p50_ms - base.p50_ms:+.2f}" if base is not None and base is not row else "-"
    cpu = "-" if row.cpu_us_per_request is None else f"{row.cpu_us_per_request:.0f}"
    return (
        f"| {row.target} | {'yes' if row.stream else 'no'} | {row.concurrency} | "
        f"{row.requests_per_s:.0f} | {row.p50_ms:.2f} | {row.p99_ms:.2f} | {added} | {cpu} | "
        f"{row.stub_cpu_us_per_request:.0f} | "
        f"{row.errors} | {', '.join(f'{k} {v}' for k, v in sorted(row.paths.items())) or '-'} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per row")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each row")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 32], help="connections per row"
    )
    parser.add_argument(
        "--stream",
        type=lambda v: v == "yes",
        nargs="+",
        default=[False, True],
        metavar="{no,yes}",
        help="non-streamed and/or streamed rows (default both)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=["direct", "rust", "agentkv", "replicas"],
        choices=("direct", "rust", "agentkv", "replicas"),
        help="which targets",
    )
    parser.add_argument("--replicas", type=int, default=2, help="agentkv routers sharing Redis")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    parser.add_argument("--vllm-router", default=shutil.which("vllm-router") or "vllm-router")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--profile", type=Path, help="write py-spy profiles of agentkv here")
    parser.add_argument(
        "--baseline",
        type=Path,
        nargs="*",
        default=[],
        metavar="DIR",
        help="also measure the agentkv router of these checkouts (e.g. a `git worktree` of the "
        "commit before a change), in the same run",
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT)
    args.wrk_script = Path(script.name)
    print(HEADER, flush=True)
    try:
        rows = run(args)
    finally:
        args.wrk_script.unlink()
    if args.out:
        args.out.write_text(json.dumps([asdict(row) for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
