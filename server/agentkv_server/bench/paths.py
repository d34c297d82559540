"""The path sweep (``agentkv bench --preset long``): what each of the router's KV paths costs
as one session's history grows, up to the 128k-token context of the ``tiny-long`` model.

Per history length, one fresh session (salted: no prefix cache is shared across lengths) runs
four turns, each through a router of its own that forces one path. The routers run in this
process and share one session store, so each finds the holding the previous turn left
(tests/engine/test_long_history.py is the same recipe, checked against the logprob oracle):

1. ``first`` (policy ``always``): nothing is held, P computes the history, D takes it over;
2. ``local`` (policy ``agentkv``): a one-block follow-up continues on its holder;
3. ``reuse`` (policy ``always``): P pulls the held history from D;
4. ``recompute`` (policy ``never``): P computes all of it again.

Turns are non-streamed chat completions with text messages, so the ``local`` turn's plan
tokenizes the whole conversation on the holder (``POST /tokenize``) as real agent traffic does,
and the router learns each holding from the response (no holding report involved). Per turn the
sweep records the router's answer (path, reused tokens, ``Server-Timing``), the engines'
counters around it (tokens P loaded from the holder, NIXL reads with their seconds and bytes,
time to first token) and this process's CPU seconds and peak RSS over the turn: the router's
own, since the client only hands a body encoded beforehand to httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentkv import protocol
from agentkv_server.bench.modes import Deployment
from agentkv_server.bench.report import JSON_NAME, MARKDOWN_NAME, _figure
from agentkv_server.bench.transfers import TransferTotals, parse_transfer_totals
from agentkv_server.bench.workload import TextTokenizer, Workload
from agentkv_server.bundle.model import DTYPE_BYTES
from agentkv_server.router import InMemoryStore
from agentkv_server.settings import PolicyName, Settings
from agentkv_server.testing import serve_in_process

__all__ = [
    "BYTES_METRIC",
    "COST_PLOT",
    "EXPECTED_PATH",
    "FORCED",
    "LOADED_METRIC",
    "TTFT_METRIC",
    "EngineCounters",
    "EngineProbe",
    "Growth",
    "PathSweep",
    "PathTurn",
    "ProcessMeter",
    "ProcessUse",
    "growth",
    "is_path_sweep",
    "kv_bytes_per_token",
    "loglog_slope",
    "model_kv_bytes_per_token",
    "parse_engine_counters",
    "render_path_markdown",
    "router_log",
    "router_settings",
    "sweep_paths",
    "write_path_report",
]

COST_PLOT = "cost_vs_history.png"
MEASURES = "paths"  # config["measures"] of a sweep's results.json

# The four turns of a session: the path each aims at, and the router policy that forces it.
FORCED: Final[tuple[tuple[str, PolicyName], ...]] = (
    ("first", "always"),
    ("local", "agentkv"),
    ("reuse", "always"),
    ("recompute", "never"),
)
# The router's x-agentkv-kv-path each forced turn should report.
EXPECTED_PATH: Final[Mapping[str, str]] = {
    "first": "recompute",
    "local": "local",
    "reuse": "reuse",
    "recompute": "recompute",
}

TTFT_METRIC = "vllm:time_to_first_token_seconds"
LOADED_METRIC = "vllm:external_prefix_cache_hits"  # tokens an engine loaded from another
BYTES_METRIC = "vllm:nixl_bytes_transferred"
# The engines' metrics of a turn settle after its response (connector stats ride on the
# next engine step): read them this much later.
_METRICS_SETTLE_S = 0.5
# A turn on the slowest path at 128k tokens runs for minutes: say every so often that it lives.
_HEARTBEAT_S = 60.0
_ROUTER_LOGGER = "agentkv_server.router"
_CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class PathTurn:
    """One turn of the sweep: the path it forced and what each cost was.

    ``seconds``: the whole non-streamed turn, client-side. ``plan_s``/``prefill_s``/``decode_s``:
    the router's ``Server-Timing`` steps (None for a step not taken). ``pulled_tokens``,
    ``pull_*``: what P loaded from the holder and its NIXL reads (the pull); ``handoff_*``: what
    D loaded from P. ``*_ttft_s``: the engines' own mean time to first token over the turn's
    requests. ``router_*``: this process over the turn (the router; the client adds < 1 ms).
    ``router_log``: the router's log lines of the turn, its path decision and reason included.
    """

    history_tokens: int
    turn: int
    forced: str
    policy: str
    kv_path: str | None = None
    prompt_tokens: int | None = None
    reused_tokens: int | None = None
    seconds: float | None = None
    plan_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    pulled_tokens: int | None = None
    pull_reads: int | None = None
    pull_s: float | None = None
    pull_bytes: int | None = None
    handoff_tokens: int | None = None
    handoff_reads: int | None = None
    handoff_s: float | None = None
    handoff_bytes: int | None = None
    prefill_ttft_s: float | None = None
    decode_ttft_s: float | None = None
    router_cpu_s: float | None = None
    router_rss_peak_bytes: int | None = None
    router_rss_growth_bytes: int | None = None
    router_log: tuple[str, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds is not None

    @property
    def took_forced_path(self) -> bool:
        return self.kv_path == EXPECTED_PATH.get(self.forced)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "router_log": list(self.router_log)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PathTurn:
        names = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        return cls(**{**values, "router_log": tuple(values.get("router_log", ()))})


@dataclass(frozen=True)
class PathSweep:
    """A whole sweep: how it ran (free-form, JSON-ready) and every turn."""

    config: dict[str, Any]
    turns: tuple[PathTurn, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": {**self.config, "measures": MEASURES},
            "turns": [t.to_dict() for t in self.turns],
            "growth": [g.to_dict() for g in growth(self.turns)],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PathSweep:
        return cls(dict(data["config"]), tuple(PathTurn.from_dict(t) for t in data["turns"]))


def is_path_sweep(data: Mapping[str, Any]) -> bool:
    """Whether a results.json holds a path sweep (else a mode comparison)."""
    return data.get("config", {}).get("measures") == MEASURES


# --- what a token of KV weighs -------------------------------------------------------------


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str | None = None) -> int:
    """KV cache one token takes on an engine, from a Hugging Face ``config.json``: keys and
    values of every layer, in ``dtype`` (default: the model's, which vLLM's KV cache takes).
    A pull of N tokens moves N times this."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


def model_kv_bytes_per_token(model_dir: Path | None) -> int | None:
    """:func:`kv_bytes_per_token` of a model directory; None without a config it can read."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    try:
        return kv_bytes_per_token(json.loads((model_dir / "config.json").read_text()))
    except (KeyError, TypeError, ValueError):
        return None


# --- what the engines counted ----------------------------------------------------------------


@dataclass(frozen=True)
class EngineCounters:
    """Totals some engines exported so far: tokens loaded from another engine (external
    prefix-cache hits), NIXL reads and their bytes, first tokens and their summed delay."""

    loaded_tokens: float
    transfers: TransferTotals
    transferred_bytes: float
    first_tokens: int
    ttft_s: float

    def __sub__(self, earlier: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.loaded_tokens - earlier.loaded_tokens,
            self.transfers - earlier.transfers,
            self.transferred_bytes - earlier.transferred_bytes,
            self.first_tokens - earlier.first_tokens,
            self.ttft_s - earlier.ttft_s,
        )

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.loaded_tokens + other.loaded_tokens,
            self.transfers + other.transfers,
            self.transferred_bytes + other.transferred_bytes,
            self.first_tokens + other.first_tokens,
            self.ttft_s + other.ttft_s,
        )

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_s / self.first_tokens if self.first_tokens > 0 else None


def parse_engine_counters(text: str) -> EngineCounters:
    """The counters in one engine's ``/metrics`` text, summed over label sets (absent: 0)."""
    sums: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] += sample.value
    return EngineCounters(
        loaded_tokens=sums[f"{LOADED_METRIC}_total"],
        transfers=parse_transfer_totals(text) or TransferTotals(0, 0.0),
        transferred_bytes=sums[f"{BYTES_METRIC}_sum"],
        first_tokens=round(sums[f"{TTFT_METRIC}_count"]),
        ttft_s=sums[f"{TTFT_METRIC}_sum"],
    )


class EngineProbe:
    """Reads one role's engines' counters; a failed scrape makes the sample None (a partial
    sum would read as less work)."""

    def __init__(self, metrics_urls: Sequence[str], client: httpx.AsyncClient) -> None:
        self._urls = tuple(metrics_urls)
        self._client = client

    async def sample(self) -> EngineCounters | None:
        total: EngineCounters | None = None
        for url in self._urls:
            try:
                response = await self._client.get(url, timeout=30.0)
                response.raise_for_status()
            except httpx.HTTPError:
                return None
            counters = parse_engine_counters(response.text)
            total = counters if total is None else total + counters
        return total


# --- what the router cost this process -----------------------------------------------------


@dataclass(frozen=True)
class ProcessUse:
    """This process over a window: CPU seconds, peak RSS and how far that peak rose above the
    RSS at the window's start (what the turn itself needed)."""

    cpu_s: float
    rss_peak_bytes: int | None
    rss_growth_bytes: int | None


class ProcessMeter:
    """Measures this process from its creation to :meth:`read`. The peak is Linux's high-water
    mark (``VmHWM``), reset at the start (``/proc/self/clear_refs``); where that cannot be
    reset, the larger of the RSS at both ends. Freed heap goes back to the OS first, so that
    the rise counts the memory the window touches, not heap an earlier one left mapped."""

    def __init__(self) -> None:
        _return_free_heap()
        self._peak_reset = _reset_peak_rss()
        self._rss = _status_bytes("VmRSS")
        self._cpu = time.process_time()

    def read(self) -> ProcessUse:
        cpu_s = time.process_time() - self._cpu
        rss = _status_bytes("VmRSS")
        peak = _status_bytes("VmHWM") if self._peak_reset else _larger(self._rss, rss)
        growth = None if peak is None or self._rss is None else max(peak - self._rss, 0)
        return ProcessUse(cpu_s, peak, growth)


def _return_free_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL(None).malloc_trim(0)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (proc(5))
    except OSError:
        return False
    return True


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes; None off Linux."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    return None


def _larger(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else max(a, b)


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self._lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.append(f"{record.levelname} {record.getMessage()}")


@contextlib.contextmanager
def router_log() -> Iterator[list[str]]:
    """The router's log lines while the block runs, debug included: its path decision with the
    reason (``session ...: KVPath.LOCAL (local_fastest) held=... new=...``) and any fallback."""
    logger = logging.getLogger(_ROUTER_LOGGER)
    lines: list[str] = []
    handler = _Lines(lines)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# --- the sweep -----------------------------------------------------------------------------


def router_settings(deployment: Deployment, policy: PolicyName, step_s: float) -> Settings:
    """A router forcing ``policy``, with every step allowed ``step_s``: a 128k-token prefill on
    one CPU core takes minutes, and vLLM's token counters stay flat until it is done. D keeps
    each turn's KV 450 s (the connector's maximum is 480) while the next turn's router starts."""
    return Settings(
        prefill_urls=deployment.prefill_urls,
        decode_urls=deployment.decode_urls,
        policy=policy,
        secret=deployment.secret,
        health_interval_s=3600.0,
        timeouts={
            "prefill_s": step_s,
            "pull_s": step_s,
            "first_token_s": step_s,
            "decode_s": step_s,
            "tokenize_s": step_s,
        },
        faults={"stall_s": step_s, "liveness_timeout_s": 10.0},
        retention={"default_s": 450.0},
    )


async def sweep_paths(
    deployment: Deployment,
    tokenizer: TextTokenizer,
    workload: Workload,
    *,
    step_s: float,
    progress: Callable[[str], None],
) -> list[PathTurn]:
    """Every history length of ``workload``, one session of the four forced turns each."""
    async with httpx.AsyncClient() as scraper:
        sweep = _Sweep(deployment, tokenizer, workload, step_s, progress, scraper)
        turns: list[PathTurn] = []
        for history in workload.history_tokens:
            turns += await sweep.session(history)
        return turns


class _Sweep:
    """What every turn of one sweep shares: engines, session store, salt, progress."""

    def __init__(
        self,
        deployment: Deployment,
        tokenizer: TextTokenizer,
        workload: Workload,
        step_s: float,
        progress: Callable[[str], None],
        scraper: httpx.AsyncClient,
    ) -> None:
        self._deployment = deployment
        self._tokenizer = tokenizer
        self._workload = workload
        self._step_s = step_s
        self._progress = progress
        self._store = InMemoryStore(max_sessions=100, ticket_ttl_s=step_s)
        self._salt = uuid.uuid4().hex[:8]  # no prefix-cache hit from an earlier run's sessions
        self._probes = {
            "prefill": EngineProbe(_metrics(deployment.prefill_urls), scraper),
            "decode": EngineProbe(_metrics(deployment.decode_urls), scraper),
        }

    async def session(self, history: int) -> list[PathTurn]:
        """One session's four turns; it stops at a failed turn (the next needs its answer)."""
        session_id = f"paths-{self._salt}-h{history}"
        system = self._workload.history_text(self._tokenizer, history, 0, session_id)
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        turns: list[PathTurn] = []
        for index, (forced, policy) in enumerate(FORCED, start=1):
            new = self._workload.new_text(self._tokenizer, history, 0, index)
            messages.append({"role": "user", "content": new})
            turn = PathTurn(history, index, forced, policy)
            record, answer = await self._turn(turn, policy, session_id, messages)
            turns.append(record)
            self._progress(_describe(record))
            if not record.ok:
                break
            messages.append({"role": "assistant", "content": answer})
        return turns

    async def _turn(
        self, turn: PathTurn, policy: PolicyName, session_id: str, messages: list[dict[str, str]]
    ) -> tuple[PathTurn, str]:
        """One turn through a router forcing ``policy``, and the answer's text."""
        body = json.dumps(self._body(messages)).encode()  # encoded outside the measured window
        headers = _turn_headers(session_id, turn.turn, last=turn.turn == len(FORCED))
        settings = router_settings(self._deployment, policy, self._step_s)
        label = f"history {turn.history_tokens}: turn {turn.turn}/{len(FORCED)} {turn.forced}"
        self._progress(f"{label} (policy {policy}) ...")
        serving = serve_in_process(settings, store=self._store, timeout_s=self._step_s + 60.0)
        async with serving as (_, router):
            before = await self._sample()
            with router_log() as log, _heartbeat(label, self._progress):
                meter = ProcessMeter()
                began = time.perf_counter()
                try:
                    response = await router.post(_CHAT_PATH, content=body, headers=headers)
                except Exception as exc:  # noqa: BLE001 - a router bug must not lose the run
                    error = f"{type(exc).__name__}: {exc}"[:500]
                    return replace(turn, error=error, router_log=tuple(log)), ""
                seconds = time.perf_counter() - began
                use = meter.read()
            await asyncio.sleep(_METRICS_SETTLE_S)
            after = await self._sample()
        turn = replace(turn, router_log=tuple(log), **_process_fields(use))
        turn = _answered(replace(turn, **_engine_fields(before, after)), response, seconds)
        return turn, _answer_text(response) if turn.ok else ""

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        output = self._workload.output_tokens
        return {
            "model": self._deployment.model,
            "messages": messages,
            "max_tokens": output,
            "min_tokens": output,  # exactly ``output`` tokens: random weights stop early
            "ignore_eos": True,
            "temperature": 0.0,
        }

    async def _sample(self) -> dict[str, EngineCounters | None]:
        return {role: await probe.sample() for role, probe in self._probes.items()}


def _metrics(urls: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"{url.rstrip('/')}/metrics" for url in urls)


def _turn_headers(session_id: str, turn: int, *, last: bool) -> dict[str, str]:
    """What the SDK tags a turn with (docs/protocol.md), and the body's type."""
    return {
        "content-type": "application/json",
        protocol.HEADER_SESSION_ID: session_id,
        protocol.HEADER_TURN: str(turn),
        protocol.HEADER_SESSION_END: "1" if last else "0",
    }


@contextlib.contextmanager
def _heartbeat(label: str, progress: Callable[[str], None]) -> Iterator[None]:
    """Says every ``_HEARTBEAT_S`` that a turn still runs (a 128k recompute takes minutes)."""

    async def beat() -> None:
        began = time.monotonic()
        while True:
            await asyncio.sleep(_HEARTBEAT_S)
            progress(f"{label}: still running, {time.monotonic() - began:.0f} s")

    task = asyncio.get_running_loop().create_task(beat())
    try:
        yield
    finally:
        task.cancel()


def _process_fields(use: ProcessUse) -> dict[str, Any]:
    return {
        "router_cpu_s": use.cpu_s,
        "router_rss_peak_bytes": use.rss_peak_bytes,
        "router_rss_growth_bytes": use.rss_growth_bytes,
    }


def _engine_fields(
    before: Mapping[str, EngineCounters | None], after: Mapping[str, EngineCounters | None]
) -> dict[str, Any]:
    """The turn's share of each role's counters: P's loads are the pull, D's the handoff."""
    out: dict[str, Any] = {}
    for role, prefix, loaded in (
        ("prefill", "pull", "pulled_tokens"),
        ("decode", "handoff", "handoff_tokens"),
    ):
        start, end = before.get(role), after.get(role)
        if start is None or end is None:
            continue
        delta = end - start
        out |= {
            loaded: round(delta.loaded_tokens),
            f"{prefix}_reads": delta.transfers.reads,
            f"{prefix}_s": delta.transfers.seconds,
            f"{prefix}_bytes": round(delta.transferred_bytes),
            f"{role}_ttft_s": delta.mean_ttft_s,
        }
    return out


def _answered(turn: PathTurn, response: httpx.Response, seconds: float) -> PathTurn:
    """``turn`` with what the router answered: an error, or path, usage and its steps."""
    if response.status_code != 200:
        return replace(turn, error=f"HTTP {response.status_code}: {response.text[:400]}")
    steps = protocol.server_timing_seconds(response.headers.get(protocol.HEADER_SERVER_TIMING, ""))
    reused = response.headers.get(protocol.HEADER_REUSED_TOKENS)
    return replace(
        turn,
        kv_path=response.headers.get(protocol.HEADER_KV_PATH),
        reused_tokens=int(reused) if reused and reused.isdigit() else None,
        prompt_tokens=(response.json().get("usage") or {}).get("prompt_tokens"),
        seconds=seconds,
        plan_s=steps.get("plan"),
        prefill_s=steps.get("prefill"),
        decode_s=steps.get("decode"),
    )


def _answer_text(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"] or ""


def _describe(turn: PathTurn) -> str:
    """One progress line per finished turn."""
    head = f"history {turn.history_tokens}: turn {turn.turn}/{len(FORCED)} {turn.forced}"
    if not turn.ok:
        return f"{head} FAILED: {turn.error}"
    line = (
        f"{head} -> {turn.kv_path} in {turn.seconds:.1f} s (prompt {turn.prompt_tokens} tokens, "
        f"pulled {turn.pulled_tokens}, router CPU {turn.router_cpu_s:.2f} s)"
    )
    if not turn.took_forced_path:
        line += " not the forced path: " + " | ".join(turn.router_log)
    return line


# --- how each cost grows, and the report ---------------------------------------------------


def _mb(value: int | None) -> float | None:
    return None if value is None else value / 1e6


@dataclass(frozen=True)
class _Cost:
    """A cost whose growth the report fits: how to read it off a turn, and the least value
    that is a measurement rather than noise (a 0.3 ms plan step, one page of RSS)."""

    value: Callable[[PathTurn], float | None]
    floor: float


# By the name the report prints (unit last).
_COSTS: Final[Mapping[str, _Cost]] = {
    "turn s": _Cost(lambda t: t.seconds, 0.01),
    "plan s": _Cost(lambda t: t.plan_s, 0.001),
    "prefill step s": _Cost(lambda t: t.prefill_s, 0.01),
    "decode step s": _Cost(lambda t: t.decode_s, 0.01),
    "pull s": _Cost(lambda t: t.pull_s, 0.001),
    "pull MB": _Cost(lambda t: _mb(t.pull_bytes), 0.1),
    "P->D MB": _Cost(lambda t: _mb(t.handoff_bytes), 0.1),
    "router CPU s": _Cost(lambda t: t.router_cpu_s, 0.001),
    "router RSS growth MB": _Cost(lambda t: _mb(t.router_rss_growth_bytes), 0.5),
    "P TTFT s": _Cost(lambda t: t.prefill_ttft_s, 0.01),
    "D TTFT s": _Cost(lambda t: t.decode_ttft_s, 0.01),
}
# Exponents within this band of 1 read as linear.
_LINEAR_BAND = 0.15


@dataclass(frozen=True)
class Growth:
    """How one cost of one forced path grows with the prompt: its values at the shortest and
    the longest prompt measured, and the exponent k of ``cost ~ tokens^k`` fitted over every
    length (least squares on log-log): 1 is linear, 2 quadratic."""

    forced: str
    cost: str
    tokens: tuple[int, int]
    values: tuple[float, float]
    exponent: float

    @property
    def ratio(self) -> float:
        return self.values[1] / self.values[0]

    @property
    def tokens_ratio(self) -> float:
        return self.tokens[1] / self.tokens[0]

    @property
    def verdict(self) -> str:
        if self.exponent > 1 + _LINEAR_BAND:
            return "worse than linear"
        if self.exponent >= 1 - _LINEAR_BAND:
            return "linear"
        return "flat" if self.exponent < 0.2 else "less than linear"

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ratio": self.ratio,
            "tokens_ratio": self.tokens_ratio,
            "verdict": self.verdict,
        }


def growth(turns: Sequence[PathTurn]) -> list[Growth]:
    """Every cost of every forced path measured above its noise floor at two prompt sizes or
    more."""
    found: list[Growth] = []
    for forced, _ in FORCED:
        for name, cost in _COSTS.items():
            points = sorted(
                (t.prompt_tokens, v)
                for t in turns
                if t.ok
                and t.forced == forced
                and t.prompt_tokens
                and (v := cost.value(t)) is not None
                and v >= cost.floor
            )
            if len({tokens for tokens, _ in points}) < 2:
                continue
            (first_tokens, first), (last_tokens, last) = points[0], points[-1]
            found.append(
                Growth(
                    forced,
                    name,
                    (first_tokens, last_tokens),
                    (first, last),
                    loglog_slope(points),
                )
            )
    return found


def loglog_slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of log(y) against log(x): the k of ``y ~ x^k``."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread


def write_path_report(sweep: PathSweep, out_dir: Path) -> list[Path]:
    """``results.json``, the cost plot and the markdown summary of ``sweep`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / JSON_NAME
    results.write_text(json.dumps(sweep.to_dict(), indent=1))
    markdown = out_dir / MARKDOWN_NAME
    markdown.write_text(render_path_markdown(sweep))
    return [results, _plot_cost(sweep.turns, out_dir / COST_PLOT), markdown]


def render_path_markdown(sweep: PathSweep) -> str:
    """The summary a person reads: one row per turn, how each cost grows, what went amiss."""
    config = sweep.config
    per_token = config.get("kv_bytes_per_token")
    lines = [
        "# agentkv bench: each KV path's cost against history",
        "",
        f"Command: `{config.get('command', 'agentkv bench --preset long')}`",
        "",
        (
            f"Model: {config.get('model', '?')}"
            + (f", {per_token} bytes of KV per token" if per_token else "")
            + f"; {config.get('duration_s', '?')} s in all; "
            f"deployment: {config.get('deployment', '?')}"
        ),
        "",
        (
            "Per history length one session of four turns, each forcing a path: `first` "
            "(nothing held: recompute), `local` (continue on the holder), `reuse` (P pulls the "
            "history from D), `recompute`. s: the whole non-streamed turn; plan: the router's "
            "plan step; pulled: tokens P loaded from the holder, pull MB and s its NIXL reads; "
            "P->D MB: what D read from P; router CPU and RSS: the bench process (the in-process "
            "router) over the turn, RSS as peak (+ rise over the turn); TTFT: the engines' own."
        ),
        "",
        *_turn_table(sweep.turns),
        "",
        *_growth_table(growth(sweep.turns)),
        *_amiss(sweep.turns),
    ]
    return "\n".join(lines) + "\n"


def _turn_table(turns: Sequence[PathTurn]) -> list[str]:
    rows = [
        (
            "| history | turn | path | prompt tokens | s | plan ms | pulled tokens | pull MB "
            "| pull s | P->D MB | router CPU s | router RSS MB | P TTFT s | D TTFT s |"
        ),
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in turns:
        rss = (
            "n/a"
            if t.router_rss_peak_bytes is None
            else f"{t.router_rss_peak_bytes / 1e6:.0f} (+{(t.router_rss_growth_bytes or 0) / 1e6:.0f})"
        )
        cells = [
            str(t.history_tokens),
            t.forced,
            (t.kv_path or "n/a") if t.ok else "FAILED",
            _int(t.prompt_tokens),
            _num(t.seconds, 2),
            _num(None if t.plan_s is None else t.plan_s * 1000, 1),
            _int(t.pulled_tokens),
            _num(_mb(t.pull_bytes), 1),
            _num(t.pull_s, 3),
            _num(_mb(t.handoff_bytes), 1),
            _num(t.router_cpu_s, 3),
            rss,
            _num(t.prefill_ttft_s, 2),
            _num(t.decode_ttft_s, 2),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _growth_table(found: Sequence[Growth]) -> list[str]:
    """One row per cost, one column per path: how far it grew from the shortest prompt to the
    longest, and the fitted exponent; bold where it grew worse than linearly."""
    if not found:
        return []
    cell = {(g.forced, g.cost): g for g in found}
    paths = [forced for forced, _ in FORCED]
    spans = {g.forced: g.tokens for g in found if g.cost == "turn s"}
    rows = [
        (
            "How each cost grows from the shortest prompt to the longest: its ratio (a linear "
            "cost grows as the prompt tokens do, first row) and the exponent k of cost ~ "
            "tokens^k fitted over every length (1: linear, 2: quadratic; **bold**: over "
            f"{1 + _LINEAR_BAND:g}); - where it stayed under its noise floor (1 ms, 0.5 MB "
            "of RSS, 0.1 MB moved):"
        ),
        "",
        "| cost | " + " | ".join(paths) + " |",
        "|---|" + "---:|" * len(paths),
        "| prompt tokens | "
        + " | ".join(
            f"{spans[p][1] / spans[p][0]:.1f}x ({spans[p][0]} - {spans[p][1]})"
            if p in spans
            else "-"
            for p in paths
        )
        + " |",
    ]
    for name in _COSTS:
        if not any((p, name) in cell for p in paths):
            continue
        rows.append(
            f"| {name} | " + " | ".join(_growth_cell(cell.get((p, name))) for p in paths) + " |"
        )
    return rows


def _growth_cell(g: Growth | None) -> str:
    if g is None:
        return "-"
    text = f"{g.ratio:.1f}x, k {g.exponent:.2f}"
    return f"**{text}**" if g.verdict == "worse than linear" else text


def _amiss(turns: Sequence[PathTurn]) -> list[str]:
    """Turns that failed or took another path than forced, with the router's own words."""
    odd = [t for t in turns if not t.ok or not t.took_forced_path]
    if not odd:
        return []
    rows = ["", "Turns that failed or did not take the forced path (the router's log):", ""]
    for t in odd:
        what = f"failed: {t.error}" if not t.ok else f"took `{t.kv_path}`"
        log = "; ".join(t.router_log) or "no router log line"
        rows.append(f"- history {t.history_tokens}, turn {t.turn} `{t.forced}` {what}. {log}")
    return rows


def _int(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


_PLOT_LABELS: Final[Mapping[str, str]] = {
    "first": "first (nothing held)",
    "local": "local",
    "reuse": "reuse (P pulls)",
    "recompute": "recompute",
}


def _plot_cost(turns: Sequence[PathTurn], path: Path) -> Path:
    """Turn seconds against prompt tokens, one line per forced path, log-log, with a line
    proportional to the prompt for reference: a steeper path grows worse than linearly."""
    figure, (ax,) = _figure()
    for forced, _ in FORCED:
        points = sorted(
            (t.prompt_tokens, t.seconds)
            for t in turns
            if t.ok and t.forced == forced and t.prompt_tokens and t.seconds
        )
        if points:
            tokens, seconds = zip(*points)
            ax.plot(tokens, seconds, marker="o", label=_PLOT_LABELS[forced])
    slowest = max(
        (t for t in turns if t.ok and t.prompt_tokens and t.seconds),
        key=lambda t: (t.prompt_tokens or 0, t.seconds or 0),
        default=None,
    )
    if slowest is not None:
        smallest = min(t.prompt_tokens or 0 for t in turns if t.ok and t.prompt_tokens)
        scale = (slowest.seconds or 0) / (slowest.prompt_tokens or 1)
        ax.plot(
            [smallest, slowest.prompt_tokens],
            [scale * smallest, slowest.seconds],
            color="black",
            linestyle=":",
            linewidth=0.8,
            label="linear",
        )
    ax.set(
        xscale="log",
        yscale="log",
        title="each KV path's turn against history",
        xlabel="prompt tokens",
        ylabel="turn seconds",
    )
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    figure.savefig(path, dpi=120)
    return path
