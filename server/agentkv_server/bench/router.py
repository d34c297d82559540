"""``agentkv bench router``: what the router adds to a turn, on stub engines, beside vllm-router.

Each configuration gets a new stub prefill and stub decode engine (``python -m
agentkv_server.testing``, one process, so that the prefill stub can pull what the decode stub
holds; holding reports go to agentkv's router as a real decode engine sends them). A closed-loop
load (every connection sends its next request when the last one is answered) drives each target
for --duration seconds per row, after a --warmup:

  direct       the decode step's request sent straight to the decode stub (the baseline: what
               one engine hop costs without any router);
  rust         vllm-router --vllm-pd-disaggregation with the two stubs;
  decode-only  agentkv router with the decode stub only (one hop);
  agentkv      agentkv router with the two stubs (P/D), without and with an x-session-id per
               connection (each turn then takes the session's holding, issues a ticket, records
               the new holding, releases the old one);
  replicas     one, then --replicas agentkv routers on one Redis store, each driven by its own
               load with its share of the connections.

Load (--load): wrk (C, one thread; the figures docs/router.md reports), or python (aiohttp in
this process: no wrk needed; its own cost is in every row, so compare rows, not absolute
figures). A row: req/s, p50 and p99 (request written to response complete), the p50 added over
the direct row, and the routers' and the stubs' CPU per request (less sensitive to a busy
machine than the rates). Not a test: nothing asserts a figure; exit status 1 if requests failed.

Two more measurements, always driven from Python (they read each answer):

  decisions    the default policy's KV path per turn of a long agent session and a short chat,
               the stubs prefilling at --prefill-us-per-token;
  sessions     --sessions agent sessions of --turns turns through a router whose index holds
               --max-sessions (every answer checked; the router's sessions held and resident
               memory sampled), beside the same turns sent straight to the stubs.

By default: direct, rust (when vllm-router is found), agentkv and replicas (when redis-server is
found). Prerequisites: wrk (apt-get install wrk) for --load wrk; vllm-router (pip install
vllm-router, in a venv of its own) for rust; redis-server for replicas; py-spy for --profile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.bench import processes
from agentkv_server.bench.processes import Stubs
from agentkv_server.errors import AgentKVServerError, ConfigError
from agentkv_server.testing.redis_server import RedisServer

__all__ = [
    "HEADER",
    "LoadResult",
    "Plan",
    "Row",
    "configure",
    "format_row",
    "plan",
    "row_of",
    "run",
    "table",
]

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
DIRECT = "stub D step"

ROW_TARGETS = ("direct", "rust", "decode-only", "agentkv", "replicas")
TARGETS = (*ROW_TARGETS, "decisions", "sessions")
DEFAULT_TARGETS = ("direct", "rust", "agentkv", "replicas")
LOADS = ("wrk", "python")
# Binary -> how to get it (what a missing one's error says).
INSTALL = {
    "wrk": "install it (apt-get install wrk) or give its path with --wrk; --load python needs none",
    "vllm-router": "install it in a venv of its own (python -m venv /tmp/vr && /tmp/vr/bin/pip "
    "install vllm-router) and give its path with --vllm-router /tmp/vr/bin/vllm-router",
    "py-spy": "install it (pip install py-spy) or give its path with --py-spy",
    "redis-server": "install it (apt-get install redis-server; scripts/install --dev does)",
}

# wrk's script: POST the body given as the first script argument; with a second argument N > 0
# every request carries the session header named by the third, "bench-<run>-<thread>-<i>" (run:
# the fourth argument, one per wrk process), i cycling over N ids (one per connection at
# closed-loop concurrency N): a session's turns mostly follow each other.
# done() prints one JSON line that is read back.
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
    """One target at one concurrency, streamed or not."""

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
    load: str = "wrk"


@dataclass(frozen=True)
class LoadResult:
    """What one load process (or task) measured against one URL."""

    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float


Finish = Callable[[], LoadResult]
Start = Callable[[str, str, int, int, float, int], Finish]  # url, body, conns, sessions, s, run


@dataclass
class Target:
    name: str
    urls: list[str]  # one per load process (a replica each)
    pids: list[int]  # processes whose CPU counts as the router's
    stub_pid: int
    sessions: bool = False
    agentkv: bool = False  # has agentkv's /metrics


@dataclass(frozen=True)
class Plan:
    """What a run measures, and the binaries it found for it."""

    targets: tuple[str, ...]
    load: str
    wrk: str | None = None
    vllm_router: str | None = None
    py_spy: str | None = None
    skipped: tuple[str, ...] = field(default=())  # notes on default targets left out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.epilog = (
        "examples:\n"
        "  agentkv bench router                                     # every row, 10 s each\n"
        "  agentkv bench router --only agentkv --concurrency 32 --duration 5\n"
        "  agentkv bench router --load python --only direct decode-only agentkv\n"
        "  agentkv bench router --only rust --vllm-router /tmp/vr/bin/vllm-router\n"
        "  agentkv bench router --baseline /tmp/before    # and an older checkout's router\n"
        "  agentkv bench router --only agentkv --profile /tmp/prof   # py-spy at c=32\n"
        "  agentkv bench router --only sessions --sessions 200 --concurrency 32"
    )
    what = parser.add_argument_group("what to measure")
    what.add_argument(
        "--only",
        nargs="+",
        choices=TARGETS,
        metavar="TARGET",
        help=f"targets, of {', '.join(TARGETS)} (default: {' '.join(DEFAULT_TARGETS)}; rust "
        "and replicas only where their binaries are found)",
    )
    what.add_argument(
        "--load",
        choices=LOADS,
        default="wrk",
        help="load generator of the rows: wrk (default) or python (aiohttp in this process)",
    )
    what.add_argument(
        "--concurrency",
        type=_positive_int,
        nargs="+",
        default=[1, 32],
        metavar="N",
        help="connections per row, closed loop (default: 1 32); sessions: at once",
    )
    what.add_argument(
        "--duration", type=_positive_float, default=10.0, metavar="S", help="seconds per row (10)"
    )
    what.add_argument(
        "--warmup",
        type=_non_negative_float,
        default=2.0,
        metavar="S",
        help="seconds of load before each row (2)",
    )
    what.add_argument(
        "--stream",
        nargs="+",
        choices=("no", "yes"),
        default=["no", "yes"],
        help="non-streamed and/or streamed rows (default: both)",
    )
    what.add_argument(
        "--replicas",
        type=_positive_int,
        default=2,
        metavar="N",
        help="agentkv routers sharing Redis in the replicas rows (2)",
    )
    what.add_argument(
        "--baseline",
        type=Path,
        nargs="+",
        default=[],
        metavar="DIR",
        help="also measure the agentkv router of these checkouts (e.g. a `git worktree` of the "
        "commit before a change), in the same run",
    )
    turns = parser.add_argument_group("decisions and sessions")
    turns.add_argument(
        "--prefill-us-per-token",
        type=_non_negative_float,
        default=200.0,
        metavar="US",
        help="the stub model's prefill cost (pulls are free) for decisions and sessions (200)",
    )
    turns.add_argument(
        "--sessions", type=_positive_int, default=200, metavar="N", help="agent sessions (200)"
    )
    turns.add_argument(
        "--turns", type=_positive_int, default=5, metavar="N", help="turns per session (5)"
    )
    turns.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=64,
        metavar="N",
        help="the router's session index bound (64)",
    )
    tools = parser.add_argument_group("tools and output")
    tools.add_argument("--wrk", metavar="PATH", help="wrk binary (default: wrk on PATH)")
    tools.add_argument(
        "--vllm-router", metavar="PATH", help="vllm-router binary (default: vllm-router on PATH)"
    )
    tools.add_argument("--py-spy", metavar="PATH", help="py-spy binary (default: py-spy on PATH)")
    tools.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="write py-spy profiles of agentkv's router at concurrency 32 here",
    )
    tools.add_argument("--out", type=Path, metavar="JSON", help="write every result here (JSON)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def find_binary(name: str, given: str | None, which: Callable[[str], str | None]) -> str | None:
    """``given`` (a path or a name on PATH) or ``name`` on PATH; None where there is none."""
    return which(given or name)


def missing(name: str, given: str | None) -> str:
    where = f"{given!r} is not an executable" if given else f"{name} is not on PATH"
    return f"{name} not found ({where}): {INSTALL[name]}"


def plan(
    args: argparse.Namespace,
    *,
    which: Callable[[str], str | None] = shutil.which,
    redis_available: Callable[[], bool] = RedisServer.available,
) -> Plan:
    """The targets to run and the binaries they need; ConfigError for one that is asked for and
    missing. A default target whose binary is missing is left out, with a note."""
    asked = tuple(dict.fromkeys(args.only)) if args.only else None
    targets = list(asked or DEFAULT_TARGETS)
    skipped: list[str] = []

    def need(target: str, name: str, given: str | None, found: bool) -> None:
        if found or target not in targets:
            return
        if asked is None and not given:  # a default target: leave it out
            targets.remove(target)
            skipped.append(f"{target} left out: {missing(name, given)}")
        else:
            raise ConfigError(missing(name, given))

    vllm_router = find_binary("vllm-router", args.vllm_router, which)
    need("rust", "vllm-router", args.vllm_router, vllm_router is not None)
    need("replicas", "redis-server", None, redis_available())
    if "replicas" in targets and args.replicas < 2:
        if asked is not None:
            raise ConfigError("replicas needs --replicas 2 or more")
        targets.remove("replicas")
        skipped.append("replicas left out: --replicas 1")
    wrk = py_spy = None
    if args.load == "wrk" and any(t in ROW_TARGETS for t in targets):
        wrk = find_binary("wrk", args.wrk, which)
        if wrk is None:
            raise ConfigError(missing("wrk", args.wrk))
    if args.profile is not None:
        if not {"decode-only", "agentkv", "replicas"} & set(targets):
            raise ConfigError("--profile profiles agentkv's router: add agentkv to --only")
        py_spy = find_binary("py-spy", args.py_spy, which)
        if py_spy is None:
            raise ConfigError(missing("py-spy", args.py_spy))
    return Plan(tuple(targets), args.load, wrk, vllm_router, py_spy, tuple(skipped))


def run(args: argparse.Namespace) -> int:
    try:
        chosen = plan(args)
    except ConfigError as exc:
        print(f"agentkv bench router: {exc}", file=sys.stderr)
        return 2
    for note in chosen.skipped:
        print(f"agentkv bench router: {note}", file=sys.stderr)
    logs = Path(tempfile.mkdtemp(prefix="agentkv-bench-router-"))
    results: dict[str, list] = {}  # what ran so far, written to --out even after a failure
    try:
        failed = _measure(args, chosen, logs, results)
    except AgentKVServerError as exc:  # a stub or router that would not start
        print(f"agentkv bench router: {exc} (logs: {logs})", file=sys.stderr)
        return 1
    finally:
        if args.out is not None and results:
            done = {kind: [asdict(item) for item in items] for kind, items in results.items()}
            args.out.write_text(json.dumps(done, indent=2))
    print(f"logs: {logs}", file=sys.stderr)
    if failed:
        print(f"{failed} request(s) failed; see the errors column and {logs}", file=sys.stderr)
    return 1 if failed else 0


def _measure(args: argparse.Namespace, chosen: Plan, logs: Path, results: dict[str, list]) -> int:
    failed = 0
    if any(t in ROW_TARGETS for t in chosen.targets):
        rows: list[Row] = []
        results["rows"] = rows
        print(f"load: {chosen.load}", flush=True)
        print(HEADER, flush=True)
        with _driver(chosen) as start:
            _rows(args, chosen, start, logs, rows)
        failed += sum(row.errors for row in rows)
    if "decisions" in chosen.targets or "sessions" in chosen.targets:
        from agentkv_server.bench import router_sessions  # aiohttp, only where it is used

        if "decisions" in chosen.targets:
            turns = router_sessions.decisions(args.prefill_us_per_token, logs)
            print("\n" + router_sessions.decisions_table(turns), flush=True)
            results["decisions"] = turns
        if "sessions" in chosen.targets:
            loads = router_sessions.session_loads(args, logs)
            print("\n" + router_sessions.session_table(loads, args.max_sessions), flush=True)
            failed += sum(load.sent - load.succeeded for load in loads)
            results["sessions"] = loads
    return failed


# --- load generators ------------------------------------------------------------------------


@contextlib.contextmanager
def _driver(chosen: Plan):  # type: ignore[no-untyped-def]
    """A function starting one load against one URL: wrk processes or Python threads."""
    if chosen.load == "python":
        yield start_python
        return
    assert chosen.wrk is not None
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_SCRIPT)
        script.flush()
        wrk, lua = chosen.wrk, script.name
        yield lambda url, body, conns, sessions, seconds, run: start_wrk(
            wrk, lua, url, body, conns, sessions, seconds, run
        )


def start_wrk(
    wrk: str,
    script: str,
    url: str,
    body: str,
    connections: int,
    sessions: int,
    seconds: float,
    run: int,
) -> Finish:
    argv = [wrk, "-t1", f"-c{connections}", f"-d{max(round(seconds), 1)}s", "--timeout", "5s"]
    argv += ["-s", script, url, "--", body, str(sessions), protocol.HEADER_SESSION_ID, str(run)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return lambda: wrk_result(proc.communicate()[0])


def wrk_result(output: str) -> LoadResult:
    """The JSON line the wrk script's done() prints."""
    for line in output.splitlines():
        if line.startswith("WRK-JSON "):
            result = json.loads(line[len("WRK-JSON ") :])
            return LoadResult(
                requests=result["requests"],
                errors=result["errors"],
                seconds=result["duration_us"] / 1e6,
                p50_ms=result["p50_us"] / 1000,
                p99_ms=result["p99_us"] / 1000,
            )
    raise AgentKVServerError(f"wrk printed no result:\n{output}")


def start_python(
    url: str, body: str, connections: int, sessions: int, seconds: float, run: int
) -> Finish:
    """The same closed loop from aiohttp, on an event loop of its own thread."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(asyncio.run, python_load(url, body, connections, sessions, seconds, run))
    pool.shutdown(wait=False)
    return future.result


async def python_load(
    url: str, body: str, connections: int, sessions: int, seconds: float, run: int
) -> LoadResult:
    import aiohttp

    data = body.encode()
    latencies: list[float] = []
    counts = {"requests": 0, "errors": 0}
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        began = time.perf_counter()
        deadline = began + seconds

        async def client(worker: int) -> None:
            headers = {"Content-Type": "application/json"}
            if sessions:
                headers[protocol.HEADER_SESSION_ID] = f"bench-{run}-0-{worker % sessions}"
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                try:
                    async with http.post(url, data=data, headers=headers) as response:
                        await response.read()
                        ok = response.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                counts["requests"] += 1
                if ok:
                    latencies.append(time.perf_counter() - sent)
                else:
                    counts["errors"] += 1

        await asyncio.gather(*(client(worker) for worker in range(connections)))
        elapsed = time.perf_counter() - began
    return LoadResult(
        counts["requests"],
        counts["errors"],
        elapsed,
        percentile_ms(latencies, 50),
        percentile_ms(latencies, 99),
    )


def percentile_ms(seconds: Sequence[float], q: int) -> float:
    if len(seconds) < 2:
        return 1000 * (seconds[0] if seconds else 0.0)
    return 1000 * statistics.quantiles(seconds, n=100)[q - 1]


# --- rows -----------------------------------------------------------------------------------


def request_body(stream: bool, direct: bool) -> str:
    body: dict[str, object] = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    if stream:
        body["stream"] = True
    if direct:
        body[wire.KV_TRANSFER_PARAMS] = DIRECT_PARAMS
    return json.dumps(body)


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


def row_of(
    target: Target,
    stream: bool,
    results: Sequence[LoadResult],
    *,
    connections: int,
    cpu_s: float,
    stub_cpu_s: float,
    paths: dict[str, int],
    load: str,
) -> Row:
    """One row from the loads (one per replica) and the CPU seconds the processes used."""
    requests = sum(r.requests for r in results)
    seconds = max(r.seconds for r in results)
    return Row(
        target=target.name,
        stream=stream,
        concurrency=connections * len(results),
        requests=requests,
        errors=sum(r.errors for r in results),
        requests_per_s=requests / seconds if seconds > 0 else 0.0,
        # Replicas: the worse of the loads' percentiles (each saw its share of the load).
        p50_ms=max(r.p50_ms for r in results),
        p99_ms=max(r.p99_ms for r in results),
        cpu_us_per_request=cpu_s / requests * 1e6 if target.pids and requests else None,
        stub_cpu_us_per_request=stub_cpu_s / max(requests, 1) * 1e6,
        paths={path: count for path, count in paths.items() if count},
        load=load,
    )


def measure(
    args: argparse.Namespace, start: Start, load: str, target: Target, stream: bool, c: int
) -> Row:
    body = request_body(stream, direct=not target.pids)
    per = max(c // len(target.urls), 1)
    sessions = per if target.sessions else 0
    urls = [url + PATH for url in target.urls]
    if args.warmup:
        for finish in [start(u, body, per, sessions, args.warmup, i) for i, u in enumerate(urls)]:
            finish()
    cpu_before, paths_before = processes.cpu_seconds(target.pids), turn_paths(target)
    stub_before = processes.cpu_seconds([target.stub_pid])
    finishes = [start(u, body, per, sessions, args.duration, i) for i, u in enumerate(urls)]
    results = [finish() for finish in finishes]
    cpu = processes.cpu_seconds(target.pids) - cpu_before
    stub_cpu = processes.cpu_seconds([target.stub_pid]) - stub_before
    paths = {k: v - paths_before.get(k, 0) for k, v in turn_paths(target).items()}
    return row_of(
        target,
        stream,
        results,
        connections=per,
        cpu_s=cpu,
        stub_cpu_s=stub_cpu,
        paths=paths,
        load=load,
    )


def profile(
    args: argparse.Namespace, py_spy: str, start: Start, target: Target, stream: bool
) -> None:
    """py-spy over the router while the load drives it at concurrency 32: a flamegraph and a
    collapsed-stack file (one line per stack, with its sample count) per mode."""
    args.profile.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in target.name.lower())
    name = f"{slug}-{'stream' if stream else 'json'}"
    body = request_body(stream, direct=False)
    seconds = args.duration
    finish = start(target.urls[0] + PATH, body, 32, 32 if target.sessions else 0, seconds + 2, 0)
    time.sleep(1)
    for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
        subprocess.run(
            [py_spy, "record", "--nonblocking", "-p", str(target.pids[0]), "-r", "250"]
            + ["-d", str(max(int(seconds / 2), 1)), "-f", fmt]
            + ["-o", str(args.profile / f"{name}.{suffix}")],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    finish()
    print(f"profile: {args.profile}/{name}.svg, .txt", file=sys.stderr)


def _rows(
    args: argparse.Namespace, chosen: Plan, start: Start, logs: Path, rows: list[Row]
) -> None:
    secret = processes.new_secret()
    ports = [processes.free_port() for _ in range(args.replicas)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]

    def stubs(stack: contextlib.ExitStack) -> Stubs:
        """New stubs per configuration: the decode stub retains what each router asks it to
        keep (vllm-router: upstream's 480 s for every request), and that must not weigh on
        the next configuration."""
        log = logs / f"stubs-{len(rows)}.log"
        return stack.enter_context(processes.start_stubs(urls[0], secret, log, record=False))

    def agentkv(
        stack: contextlib.ExitStack,
        name: str,
        *,
        sessions: bool,
        prefill: bool = True,
        redis: str | None = None,
        count: int = 1,
        source: Path | None = None,
    ) -> Target:
        pair = stubs(stack)
        env = dict(os.environ)
        if source is not None:  # another checkout's router (sdk, server, integrations)
            tree = [str(source / part) for part in ("sdk", "server", "integrations")]
            env["PYTHONPATH"] = os.pathsep.join(tree)
        argvs = [
            processes.router_argv(
                port, secret, [pair.prefill] if prefill else [], [pair.decode], redis_url=redis
            )
            for port in ports[:count]
        ]
        procs = [
            stack.enter_context(
                processes.process(a, logs / f"agentkv-{i}-{len(rows)}.log", env=env)
            )
            for i, a in enumerate(argvs)
        ]
        for url, proc in zip(urls, procs):
            processes.wait_healthy(url, proc)
        pids = [proc.pid for proc in procs]
        return Target(name, urls[:count], pids, pair.pid, sessions, agentkv=True)

    def measure_all(target: Target) -> None:
        for stream in (mode == "yes" for mode in args.stream):
            if chosen.py_spy is not None and target.agentkv:
                profile(args, chosen.py_spy, start, target, stream)
            for concurrency in args.concurrency:
                row = measure(args, start, chosen.load, target, stream, concurrency)
                rows.append(row)
                print(format_row(row, rows), flush=True)

    if "direct" in chosen.targets:
        with contextlib.ExitStack() as stack:
            pair = stubs(stack)
            measure_all(Target(DIRECT, [pair.decode], [], pair.pid))
    if "rust" in chosen.targets:
        assert chosen.vllm_router is not None
        with contextlib.ExitStack() as stack:
            pair = stubs(stack)
            port = processes.free_port()
            argv = processes.vllm_router_argv(chosen.vllm_router, port, pair)
            rust = stack.enter_context(processes.process(argv, logs / "vllm-router.log"))
            url = f"http://127.0.0.1:{port}"
            processes.wait_healthy(url, rust)
            measure_all(Target("vllm-router P/D", [url], [rust.pid], pair.pid))
    if "decode-only" in chosen.targets:
        with contextlib.ExitStack() as stack:
            measure_all(agentkv(stack, "agentkv decode-only", sessions=False, prefill=False))
    if "agentkv" in chosen.targets:
        sources = [(None, "")] + [(src, f" [{src.name}]") for src in args.baseline]
        for source, label in sources:
            for sessions in (False, True):
                name = f"agentkv P/D{' + session' if sessions else ''}{label}"
                with contextlib.ExitStack() as stack:
                    measure_all(agentkv(stack, name, sessions=sessions, source=source))
    if "replicas" in chosen.targets:
        # One process on the same Redis first: what the shared store costs, apart from what
        # more processes add.
        for count in (1, args.replicas):
            with contextlib.ExitStack() as stack:
                redis = stack.enter_context(RedisServer())
                name = f"agentkv P/D + session, Redis, {count} replica{'s' if count > 1 else ''}"
                measure_all(agentkv(stack, name, sessions=True, redis=redis.url, count=count))


# --- the table ------------------------------------------------------------------------------

HEADER = (
    "| target | stream | c | req/s | p50 ms | p99 ms | +p50 ms vs stub | router CPU us/req | "
    "stubs CPU us/req | errors | agentkv paths |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: Row, rows: Sequence[Row]) -> str:
    """``row`` as a line of HEADER's table; +p50 against the direct row of the same kind among
    ``rows``, where there is one."""
    base = next(
        (
            r
            for r in rows
            if r.target == DIRECT and r.stream == row.stream and r.concurrency == row.concurrency
        ),
        None,
    )
    added = f"{row.p50_ms - base.p50_ms:+.2f}" if base is not None and base is not row else "-"
    cpu = "-" if row.cpu_us_per_request is None else f"{row.cpu_us_per_request:.0f}"
    paths = ", ".join(f"{k} {v}" for k, v in sorted(row.paths.items())) or "-"
    return (
        f"| {row.target} | {'yes' if row.stream else 'no'} | {row.concurrency} | "
        f"{row.requests_per_s:.0f} | {row.p50_ms:.2f} | {row.p99_ms:.2f} | {added} | {cpu} | "
        f"{row.stub_cpu_us_per_request:.0f} | {row.errors} | {paths} |"
    )


def table(rows: Sequence[Row]) -> str:
    return "\n".join([HEADER, *(format_row(row, rows) for row in rows)])
