"""The soak's machinery: the real 1P2D stack under concurrent agent sessions while engines die
and come back, the report it prints, and the criteria test_soak.py asserts.

Starts 1P2D (router, one prefill and two decode engines, the tiny random-weight test model),
then for ``minutes`` runs ``sessions`` concurrent agent sessions through the agentkv SDK:
token-id turns whose history grows by the answer plus a tool result, a random tool gap between
turns, every ``stream_every``-th turn streamed, a fresh session after ``turns`` turns. Every
``kill_every_s`` seconds after the previous engine came back, a random engine is SIGKILLed and
started again on its ports, under a fresh NIXL engine id as a supervisor would
(``same_engine_id``: its old one); one engine is down at a time. A sample of non-streamed turns
(every ``oracle_every``-th) is checked by the oracle: first-token top-5 logprobs against a
recompute from scratch (docs/engines.md); each failed check is printed in full and written, with
its prompt, to ``<log_dir>/oracle-failures.jsonl``. Before a restart the soak waits up to
``PORTS_FREE_WAIT_S`` for the engine's ports (the router knows engines by address); a port still
held fails that restart, naming its holder, and the kills go on.

Every field of SoakConfig can be set from the environment as ``AGENTKV_SOAK_<FIELD>``
(docs/faults.md, "Soak"). The criteria and their windows are the constants below; Outcome's
``criteria`` applies them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

import agentkv
from agentkv_server.bench.transfers import TransferTotals, parse_transfer_totals
from agentkv_server.bundle.launcher import AGENTKV_CONNECTOR, EngineProcess, EngineSpec
from agentkv_server.bundle.ports import ensure_ports_free
from agentkv_server.bundle.process import ManagedProcess
from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.errors import PortInUseError
from agentkv_server.testing.probe import LOGPROB_TOLERANCE, EngineClient, KVProbe, logprob_gap

ENV_PREFIX = "AGENTKV_SOAK_"
TOP_K = 5
HOLDINGS_EVERY_S = 10.0
# A killed engine's ports can stay held a while by its dying processes; the first soak's fourth
# restart found one taken at once (docs/faults.md).
PORTS_FREE_WAIT_S = 60.0
# No kill this close to the end: the last turns would only measure the kill.
NO_KILL_BEFORE_END_S = 30.0
STALLS = ("agentkv_engine_errors_total", 'kind="stall"')
FALLBACKS = ("agentkv_turns_total", 'path="fallback"')
# Reads the connector abandoned (past their deadline, or their peer failed) or NIXL failed.
FAILED_READS = "vllm:nixl_num_failed_transfers_total"
FAILED_READS_POLL_S = 2.0

# The criteria (docs/faults.md, "Soak", says why each).
# A failed read is excused when the poll interval that saw it overlaps [kill, kill + this]: a
# read in flight from the killed engine fails at once (0.12 s measured) or, if UCX still calls it
# in progress, within the connector's peer probe (1 s) plus a step; a read the router planned
# before its liveness probe saw the death fails at once and quarantines the dead peer; and every
# read ends by its deadline, agentkv_pull_timeout_seconds (5 s) plus its bytes at 500 MB/s
# (milliseconds for the tiny model). 15 s covers the slowest of those with a loaded CPU stack's
# steps and metrics publication on top; a failure later than that was between live engines.
KILL_READ_WINDOW_S = 15.0
# Fallback turns are expected while a killed holder's sessions are re-placed: their next turn
# after the kill. Turns that begin within this long after a kill do not count.
FALLBACK_WINDOW_S = 60.0
# The report's reuse share before a kill and after the engine's return (reuse_around_restarts).
REUSE_WINDOW_S = 120.0
MAX_FALLBACK_SHARE = 0.05
MAX_P99_GROWTH = 1.2
# Each process tree's RSS at the end over its RSS when it started serving. The 30-minute runs
# grew 1-5 % (allocator arenas, prefix-cache pages, lazily loaded code); 25 % is five times that,
# so warm-up never fails a run, while a leak per turn, transfer or kill (a few hundred KB per
# turn for an engine) crosses it within a 30-minute soak.
MAX_RSS_GROWTH = 1.25


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 30.0
    kill_every_s: float = 150.0  # after the previous restart came back; 0: no kills
    sessions: int = 4
    turns: int = 6  # per agent session
    history: int = 400  # tokens before turn 1
    new_tokens: int = 100  # the tool result per turn
    output_tokens: int = 16
    max_tool_gap_s: float = 3.0  # uniform
    stream_every: int = 3
    oracle_every: int = 4
    same_engine_id: bool = False  # restart under the old NIXL engine id (default: a fresh one)
    turn_timeout_s: float = 300.0
    # A restarted engine's start, until its health check passes (docs/faults.md).
    restart_s: float = 600.0
    policy: str = "always"  # the router's (always: every pull)
    model: str = "tiny"
    seed: int = 0
    log_dir: Path = Path(".agentkv/soak")
    # Into the engines' kv_connector_extra_config; from the environment "KEY=VALUE,KEY=VALUE"
    # (true/false and numbers parsed).
    connector_settings: tuple[tuple[str, bool | int | float | str], ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SoakConfig:
        """The defaults, each overridden by ``AGENTKV_SOAK_<FIELD>`` where set."""
        values: dict[str, Any] = {}
        for spec in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + spec.name.upper())
            if raw is None or raw == "":
                continue
            default = spec.default
            if isinstance(default, bool):
                values[spec.name] = _boolean(spec.name, raw)
            elif isinstance(default, tuple):
                values[spec.name] = tuple(map(connector_setting, filter(None, raw.split(","))))
            else:
                values[spec.name] = type(default)(raw)
        return cls(**values)

    @property
    def seconds(self) -> float:
        return self.minutes * 60

    @property
    def timeout_s(self) -> float:
        """The test's bound: the soak, and room for the stack's start and a last restart."""
        return self.seconds + 2 * self.restart_s + 600


def _boolean(name: str, raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r}: not true or false")


def connector_setting(text: str) -> tuple[str, bool | int | float | str]:
    """``KEY=VALUE``, the value as JSON would type it: true/false, an int, a float, else text."""
    key, equals, raw = text.strip().partition("=")
    if not key or not equals:
        raise ValueError(f"{text!r} is not KEY=VALUE")
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


@dataclass
class Turn:
    session: str
    index: int  # 1 for a session's first turn
    began: float  # seconds since the soak started
    seconds: float
    path: str
    streamed: bool
    correct: bool | None = None  # None: not in the oracle's sample


@dataclass(frozen=True)
class Verdict:
    """The oracle's recompute of one turn's first token, and how far the turn's answer was."""

    gap: float
    wanted: dict[str, float]
    engine: str  # the engine that recomputed


@dataclass(frozen=True)
class OracleFailure:
    turn: Turn
    prompt: list[int]
    got: dict[str, float]
    verdict: Verdict

    def describe(self) -> str:
        turn, verdict = self.turn, self.verdict
        return (
            f"{turn.session} turn {turn.index} at {turn.began:.0f} s, path {turn.path}, "
            f"{'streamed' if turn.streamed else 'not streamed'}, {len(self.prompt)} prompt "
            f"tokens, recomputed on {verdict.engine}: gap {verdict.gap:.3g}\n"
            f"    got    {top_k(self.got)}\n    wanted {top_k(verdict.wanted)}"
        )


@dataclass(frozen=True)
class Sample:
    """Counters read at the start of a third: the router's, and each engine's transfer time."""

    stalls: float
    fallbacks: float
    transfers: dict[str, TransferTotals]  # by engine, since its start
    failed_reads: dict[str, float]  # by engine, since its start


@dataclass(frozen=True)
class Kill:
    at: float  # seconds since the soak started, just before the SIGKILL
    engine: str
    ports_free_after: float | None = None
    back_after: float | None = None  # healthy again after; None: the restart failed
    error: str | None = None

    def recovering(self, moment: float) -> bool:
        """From the kill until ``FALLBACK_WINDOW_S`` after the engine is back: while it is down
        its turns are served without it, and a restarted engine has that long to be in full
        use again (its pairs handshaken and moving KV)."""
        end = math.inf if self.back_after is None else self.at + self.back_after
        return self.at <= moment < end + FALLBACK_WINDOW_S

    def describe(self) -> str:
        if self.back_after is None:
            return f"{self.at:.0f} s: killed {self.engine}, restart FAILED ({self.error})"
        return (
            f"{self.at:.0f} s: killed {self.engine}, ports free after "
            f"{self.ports_free_after:.0f} s, back in {self.back_after:.0f} s"
        )


@dataclass(frozen=True)
class FailedReads:
    """``count`` failed or abandoned reads on ``engine``, seen between two polls."""

    engine: str
    since: float  # seconds since the soak started
    until: float
    count: float

    def near(self, kills: list[Kill]) -> bool:
        """Whether the interval overlaps [kill, kill + KILL_READ_WINDOW_S] of some kill."""
        return any(
            self.since <= kill.at + KILL_READ_WINDOW_S and kill.at <= self.until for kill in kills
        )


@dataclass(frozen=True)
class Rss:
    """A process tree's resident memory (MiB) when it began serving and at the soak's end."""

    name: str
    pid: int
    started_at: float  # seconds since the soak started; <= 0 for the stack's first processes
    start: float
    end: float | None = None  # None: killed before the end


@dataclass
class Tally:
    sent: int = 0
    turns: list[Turn] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    checked: int = 0
    correct: int = 0
    swaps_at_cut: int = 0  # correct, with top-k sets that differ by a swap within tolerance
    failures: list[OracleFailure] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    holdings: list[tuple[float, int]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    failed_reads: list[FailedReads] = field(default_factory=list)
    rss: dict[int, Rss] = field(default_factory=dict)  # by pid


@dataclass(frozen=True)
class Criterion:
    name: str
    bound: str
    measured: str
    passed: bool
    detail: str  # the assertion's message: the numbers behind the verdict


@dataclass
class Outcome:
    config: SoakConfig
    tally: Tally

    @property
    def answered(self) -> int:
        return len(self.tally.turns)

    @property
    def lost(self) -> int:
        return self.tally.sent - self.answered

    def third(self, which: int) -> list[Turn]:
        """The turns that began in the first (0), second (1) or last (2) third."""
        cut = self.config.seconds / 3
        return [t for t in self.tally.turns if min(int(t.began // cut), 2) == which]

    def criteria(self) -> dict[str, Criterion]:
        return {
            c.name: c
            for c in (
                self.ran_as_planned(),
                self.no_lost_turns(),
                self.no_wrong_answers(),
                self.no_failed_reads(),
                self.few_fallbacks(),
                self.p99_steady(),
                self.rss_flat(),
            )
        }

    def ran_as_planned(self) -> Criterion:
        """Not a criterion of the stack's: that the soak tested what it claims to."""
        tally, config = self.tally, self.config
        failed = [k for k in tally.kills if k.back_after is None]
        kills_due = config.kill_every_s > 0 and (
            config.seconds > config.kill_every_s + NO_KILL_BEFORE_END_S
        )
        problems = []
        if not self.answered:
            problems.append("no turn was answered")
        if not tally.checked:
            problems.append("the oracle checked no turn")
        if kills_due and not tally.kills:
            problems.append(f"no engine was killed (one due every {config.kill_every_s:g} s)")
        problems += [f"restart failed: {k.describe()}" for k in failed]
        return Criterion(
            "ran as planned",
            "turns answered, oracle sample, kills, every restart back",
            f"{self.answered} answered, {tally.checked} checked, {len(tally.kills)} kills, "
            f"{len(tally.kills) - len(failed)} back",
            not problems,
            "; ".join(problems) or "ok",
        )

    def no_lost_turns(self) -> Criterion:
        tally = self.tally
        errors = ", ".join(f"{n} x {error}" for error, n in tally.errors.most_common(5))
        return Criterion(
            "lost turns",
            "0",
            f"{self.lost} of {tally.sent}",
            self.lost == 0,
            f"{self.lost} of {tally.sent} turns sent were not answered; errors: {errors or '-'}",
        )

    def no_wrong_answers(self) -> Criterion:
        tally = self.tally
        wrong = len(tally.failures)
        first = f"; first: {tally.failures[0].describe()}" if wrong else ""
        return Criterion(
            "wrong answers",
            "0",
            f"{wrong} of {tally.checked} checked",
            wrong == 0,
            f"{wrong} of {tally.checked} turns checked by the oracle were wrong{first}",
        )

    def no_failed_reads(self) -> Criterion:
        reads = self.tally.failed_reads
        near = sum(r.count for r in reads if r.near(self.tally.kills))
        far = [r for r in reads if not r.near(self.tally.kills)]
        where = ", ".join(
            f"{r.count:.0f} on {r.engine} in {r.since:.0f}-{r.until:.0f} s" for r in far
        )
        count = sum(r.count for r in far)
        return Criterion(
            "failed KV reads",
            f"0 outside [kill, kill + {KILL_READ_WINDOW_S:g} s]",
            f"{count:.0f} outside, {near:.0f} within",
            count == 0,
            f"{count:.0f} KV reads failed or were abandoned between live engines "
            f"({where or '-'}); {near:.0f} more within {KILL_READ_WINDOW_S:g} s of a kill "
            f"(kills at {', '.join(f'{k.at:.0f}' for k in self.tally.kills) or '-'} s)",
        )

    def few_fallbacks(self) -> Criterion:
        kills = self.tally.kills
        counted = [t for t in self.tally.turns if not any(k.recovering(t.began) for k in kills)]
        fallbacks = sum(t.path == "fallback" for t in counted)
        share = fallbacks / len(counted) if counted else 0.0
        return Criterion(
            "fallback turns",
            f"<= {MAX_FALLBACK_SHARE:.0%} outside [kill, back + {FALLBACK_WINDOW_S:g} s)",
            f"{fallbacks} of {len(counted)} ({share:.1%})",
            bool(counted) and share <= MAX_FALLBACK_SHARE,
            f"{fallbacks} of the {len(counted)} turns that did not begin between a kill and "
            f"{FALLBACK_WINDOW_S:g} s after the engine was back were fallback turns ({share:.1%}, bound "
            f"{MAX_FALLBACK_SHARE:.0%}); the {self.answered - len(counted)} turns within those "
            "windows do not count",
        )

    def p99_steady(self) -> Criterion:
        first, last = ([t.seconds for t in self.third(i)] for i in (0, 2))
        p_first, p_last = p99(first), p99(last)
        ratio = p_last / p_first if first and last and p_first > 0 else math.inf
        return Criterion(
            "p99 drift",
            f"last third <= {MAX_P99_GROWTH:g} x first third",
            f"{p_last:.2f} s / {p_first:.2f} s = {ratio:.2f}",
            ratio <= MAX_P99_GROWTH,
            f"p99 turn time of the last third {p_last:.2f} s ({len(last)} turns) vs the first "
            f"third's {p_first:.2f} s ({len(first)} turns): {ratio:.2f} x, bound "
            f"{MAX_P99_GROWTH:g} x",
        )

    def rss_flat(self) -> Criterion:
        trees = [r for r in self.tally.rss.values() if r.end is not None]
        grown = [r for r in trees if not r.end <= MAX_RSS_GROWTH * r.start]  # NaN fails too
        worst = max(trees, key=lambda r: r.end / r.start if r.start else math.inf, default=None)
        return Criterion(
            "RSS",
            f"end <= {MAX_RSS_GROWTH:g} x start, each process tree",
            f"worst {worst.name} {worst.start:.0f} -> {worst.end:.0f} MiB" if worst else "-",
            bool(trees) and not grown,
            "process trees whose RSS grew past "
            f"{MAX_RSS_GROWTH:g} x: "
            + (", ".join(f"{r.name} {r.start:.0f} -> {r.end:.0f} MiB" for r in grown) or "none")
            + f" (of {len(trees)} alive at the end)",
        )


class Soak:
    def __init__(self, stack: Stack, config: SoakConfig) -> None:
        self.stack = stack
        self.config = config
        self.rng = random.Random(config.seed)
        self.chaos_rng = random.Random(f"{config.seed}-kills")  # victims independent of timing
        self.tally = Tally()
        self.started = time.monotonic()
        self.deadline = self.started + config.seconds
        self.client = agentkv.AsyncOpenAI(
            base_url=f"{stack.endpoint}/v1", api_key="-", timeout=config.turn_timeout_s
        )
        # The failed-read counter of each engine process (pid) at its last poll.
        self.read_counters: dict[int, tuple[float, float]] = {}

    def now(self) -> float:
        return time.monotonic() - self.started

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 4000) for _ in range(n)]

    async def run(self) -> Outcome:
        (self.config.log_dir / "oracle-failures.jsonl").unlink(missing_ok=True)
        for process in self.processes():
            self.note_rss(process, started_at=0.0)
        for pid, _, value in await asyncio.to_thread(self.poll_failed_reads):
            self.read_counters[pid] = (0.0, value)
        self.tally.samples.append(await asyncio.to_thread(self.sample))
        workers = [self.agent(index) for index in range(self.config.sessions)]
        watchers = [self.watch_holdings(), self.watch_thirds(), self.watch_failed_reads()]
        await asyncio.gather(*workers, self.chaos(), *watchers)
        await self.count_failed_reads()  # the last turns' reads, and a late restart's
        self.tally.samples.append(await asyncio.to_thread(self.sample))
        for process in self.processes():
            if process.pid in self.tally.rss:
                end = rss_mib(process)
                self.tally.rss[process.pid] = dataclasses.replace(
                    self.tally.rss[process.pid], end=end
                )
        return Outcome(self.config, self.tally)

    def processes(self) -> list[ManagedProcess]:
        stack = self.stack
        return [*stack.engines, *([stack.router] if stack.router else [])]

    def note_rss(self, process: ManagedProcess, started_at: float) -> None:
        if process.pid is not None:
            self.tally.rss[process.pid] = Rss(
                process.name, process.pid, started_at, rss_mib(process)
            )

    async def agent(self, index: int) -> None:
        config = self.config
        generation = 0
        while time.monotonic() < self.deadline:
            generation += 1
            prompt = self.tokens(config.history)
            name = f"soak-{index}-{generation}"
            async with agentkv.session(name) as session:
                for turn in range(config.turns):
                    if time.monotonic() >= self.deadline:
                        return
                    if turn == config.turns - 1:
                        session.end_next_turn()
                    output = await self.turn(session, (name, turn + 1), prompt)
                    if output is None:
                        break  # a lost turn: the agent starts over
                    prompt = prompt + output + self.tokens(config.new_tokens)
                    await asyncio.sleep(self.rng.uniform(0, config.max_tool_gap_s))

    async def turn(
        self, session: agentkv.Session, where: tuple[str, int], prompt: list[int]
    ) -> list[int] | None:
        """One turn; its output token ids, or None when it was not answered."""
        tally = self.tally
        tally.sent += 1
        streamed = tally.sent % self.config.stream_every == 0
        checked = not streamed and tally.sent % self.config.oracle_every == 0
        began = time.monotonic()
        try:
            if streamed:
                output, first_logprobs = await self.streamed(prompt), None
            else:
                output, first_logprobs = await self.complete(prompt)
        except Exception as exc:  # noqa: BLE001 - every failure is a lost turn, counted by kind
            tally.errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
            return None
        last = session.last_turn
        record = Turn(
            *where,
            began - self.started,
            time.monotonic() - began,
            (last.kv_path if last else None) or "?",
            streamed,
        )
        if checked and first_logprobs is not None:
            verdict = await asyncio.to_thread(self.oracle, prompt, first_logprobs)
            if verdict is not None:
                self.judge(record, prompt, first_logprobs, verdict)
        tally.turns.append(record)
        return output

    def judge(
        self, record: Turn, prompt: list[int], got: dict[str, float], verdict: Verdict
    ) -> None:
        """Count the oracle's verdict; keep a failed check whole, to reproduce it."""
        tally = self.tally
        tally.checked += 1
        record.correct = verdict.gap < LOGPROB_TOLERANCE
        if record.correct:
            tally.correct += 1
            tally.swaps_at_cut += got.keys() != verdict.wanted.keys()
            return
        failure = OracleFailure(record, prompt, got, verdict)
        tally.failures.append(failure)
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.config.log_dir / "oracle-failures.jsonl").open("a") as log:
            log.write(json.dumps(dataclasses.asdict(failure)) + "\n")

    def create(self, prompt: list[int], **options: Any) -> Any:
        return self.client.completions.create(
            model=self.stack.served_name,
            prompt=prompt,
            max_tokens=self.config.output_tokens,
            temperature=0,
            extra_body={
                "ignore_eos": True,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
            **options,
        )

    async def complete(self, prompt: list[int]) -> tuple[list[int], dict[str, float]]:
        choice = (await self.create(prompt, logprobs=TOP_K)).choices[0]
        assert choice.logprobs is not None and choice.logprobs.top_logprobs
        return choice.model_extra["token_ids"], choice.logprobs.top_logprobs[0]

    async def streamed(self, prompt: list[int]) -> list[int]:
        output: list[int] = []
        async for chunk in await self.create(prompt, stream=True):
            for choice in chunk.choices:
                output += (choice.model_extra or {}).get("token_ids") or []
        if len(output) != self.config.output_tokens:
            raise RuntimeError(f"stream ended after {len(output)} tokens")
        return output

    def oracle(self, prompt: list[int], got: dict[str, float]) -> Verdict | None:
        """The first token's top-k logprobs recomputed on any engine that is up; None (an
        error) when none answered."""
        for engine in list(self.stack.engines):
            client = EngineClient(engine.url, self.stack.served_name, timeout=120)
            try:
                wanted = KVProbe(client, client, top_k=TOP_K).recomputed_logprobs(prompt)
            except OSError:
                continue  # killed or restarting: try another
            return Verdict(logprob_gap(got, wanted), wanted, engine.name)
        self.tally.errors["oracle: no engine answered"] += 1
        return None

    async def chaos(self) -> None:
        """Kill a random engine ``kill_every_s`` after the previous one came back (0: never),
        and start it again; no kill in the last NO_KILL_BEFORE_END_S."""
        every = self.config.kill_every_s
        while every > 0 and time.monotonic() + every < self.deadline - NO_KILL_BEFORE_END_S:
            await asyncio.sleep(every)
            await self.kill_and_restart(self.chaos_rng.randrange(len(self.stack.engines)))

    async def kill_and_restart(self, index: int) -> None:
        """SIGKILL engine ``index`` and start it again on its ports; a failed restart is
        recorded, and that engine stays down until a later kill picks it again."""
        victim = self.stack.engines[index]
        at = self.now()
        victim.kill()
        began = time.monotonic()
        # A supervisor restarts an engine under a new NIXL engine id (docs/deploy.md);
        # same_engine_id restarts it under its old one.
        # Its own log: the killed engine's stays for a post-mortem.
        log_path = victim.spec.log_path.with_stem(f"{victim.name}-{round(at)}s")
        # Its cores bound once it is healthy: its imports would otherwise share a core with the
        # loaded engines, as a supervisor's restart on a host of its own would not (the
        # launcher's pin_when_healthy; docs/faults.md).
        spec = dataclasses.replace(victim.spec, log_path=log_path, pin_when_healthy=True)
        if not self.config.same_engine_id:
            spec = dataclasses.replace(spec, fresh_engine_id=True)
        replacement = EngineProcess(spec)
        self.stack.engines[index] = replacement
        freed = None
        try:
            await asyncio.to_thread(wait_ports_free, victim.spec, PORTS_FREE_WAIT_S)
            freed = time.monotonic() - began
            await asyncio.to_thread(replacement.start)
            await asyncio.to_thread(replacement.wait_healthy, self.config.restart_s)
        except Exception as exc:  # noqa: BLE001 - a failed restart is a finding, not a crash
            error = str(exc).splitlines()[0]
            self.tally.errors[f"restart of {victim.name}: {error}"] += 1
            self.tally.kills.append(Kill(at, victim.name, freed, None, error))
            return
        assert replacement.pid is not None
        # A new process counts its failed reads from 0, and none before it serves.
        self.read_counters[replacement.pid] = (self.now(), 0.0)
        self.note_rss(replacement, started_at=self.now())
        self.tally.kills.append(Kill(at, victim.name, freed, time.monotonic() - began))

    async def watch_failed_reads(self) -> None:
        while time.monotonic() < self.deadline:
            await self.count_failed_reads()
            await asyncio.sleep(FAILED_READS_POLL_S)

    async def count_failed_reads(self) -> None:
        """Poll every engine's failed reads; an increase since an engine's last poll is
        recorded with the interval between the two polls."""
        for pid, name, value in await asyncio.to_thread(self.poll_failed_reads):
            if pid not in self.read_counters:
                continue  # a replacement not yet healthy (kill_and_restart registers it)
            since, before = self.read_counters[pid]
            until = self.now()
            if value > before:
                self.tally.failed_reads.append(FailedReads(name, since, until, value - before))
            self.read_counters[pid] = (until, value)

    def poll_failed_reads(self) -> list[tuple[int, str, float]]:
        """(pid, name, failed reads since its start) of each engine that answered."""
        counters = []
        for engine in list(self.stack.engines):
            pid = engine.pid
            text = scrape(engine.url) if pid is not None else None
            if text is not None:
                counters.append((pid, engine.name, total(text, FAILED_READS)))
        return counters

    async def watch_thirds(self) -> None:
        """Sample the counters as the second and the last third begin."""
        third = self.config.seconds / 3
        for at in (third, 2 * third):
            await asyncio.sleep(max(0.0, self.started + at - time.monotonic()))
            self.tally.samples.append(await asyncio.to_thread(self.sample))

    def sample(self) -> Sample:
        router = scrape(self.stack.endpoint)
        transfers, failed_reads = {}, {}
        for engine in list(self.stack.engines):
            text = scrape(engine.url)
            totals = parse_transfer_totals(text or "")
            if totals is not None:
                transfers[engine.name] = totals
                failed_reads[engine.name] = total(text or "", FAILED_READS)
        return Sample(
            stalls=total(router or "", *STALLS),
            fallbacks=total(router or "", *FALLBACKS),
            transfers=transfers,
            failed_reads=failed_reads,
        )

    async def watch_holdings(self) -> None:
        while time.monotonic() < self.deadline:
            held = await asyncio.to_thread(self.sessions_held)
            self.tally.holdings.append((self.now(), held))
            await asyncio.sleep(HOLDINGS_EVERY_S)

    def sessions_held(self) -> int:
        text = scrape(self.stack.endpoint)
        return -1 if text is None else round(total(text, "agentkv_sessions_held"))


def stack_config(config: SoakConfig) -> StackConfig:
    """1P2D of ``config.model`` in fp32 (the engine tier's dtype), the connector's settings."""
    extra_config = {**AGENTKV_CONNECTOR.extra_config, **dict(config.connector_settings)}
    return StackConfig(
        model=config.model,
        port=0,
        decode=2,
        log_dir=config.log_dir,
        router_settings={"policy": config.policy},
        connector=dataclasses.replace(AGENTKV_CONNECTOR, extra_config=extra_config),
    )


def soak(config: SoakConfig) -> Outcome:
    """Start the stack, soak it, stop it; print the report and return the outcome."""
    with Stack(stack_config(config)) as stack:
        outcome = asyncio.run(Soak(stack, config).run())
    print(report(outcome))
    return outcome


def wait_ports_free(spec: EngineSpec, seconds: float) -> None:
    """Return once ``spec``'s ports are free; after ``seconds``, the PortInUseError that names
    the port and its holder."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            ensure_ports_free(spec.host, [spec.port, spec.side_channel_port])
            return
        except PortInUseError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def scrape(url: str) -> str | None:
    """``url``'s /metrics text; None when it does not answer (a killed or restarting engine)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
            return answer.read().decode()
    except OSError:
        return None


def total(text: str, name: str, label: str = "") -> float:
    """A metric summed over its label sets that contain ``label``."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and label in line
    )


def top_k(logprobs: dict[str, float]) -> str:
    ranked = sorted(logprobs.items(), key=lambda item: -item[1])
    return ", ".join(f"{token.removeprefix('token_id:')}: {value:.6f}" for token, value in ranked)


def rss_mib(process: ManagedProcess) -> float:
    """The resident memory of ``process`` and all its children, MiB; NaN if unreadable."""
    if process.pid is None:
        return math.nan
    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
        return sum(p.memory_info().rss for p in tree) / 2**20
    except psutil.Error:
        return math.nan


def p99(seconds: list[float]) -> float:
    if not seconds:
        return math.nan
    if len(seconds) == 1:
        return seconds[0]
    return statistics.quantiles(seconds, n=100, method="inclusive")[98]


def percentiles(seconds: list[float]) -> str:
    if not seconds:
        return "-"
    return f"{statistics.median(seconds):.2f} / {p99(seconds):.2f} ({len(seconds)})"


def thirds_table(samples: list[Sample]) -> list[str]:
    """Per third: the router's pull stalls and fallback turns, the engines' KV transfers and
    failed or abandoned reads. An engine restarted within a third counts only its transfers
    since the restart."""
    lines = [
        "| third | pull stalls | fallback turns | KV transfers | mean transfer ms | failed reads |",
        "|---|---|---|---|---|---|",
    ]
    for third, (before, after) in enumerate(itertools.pairwise(samples), start=1):
        moved, failed = TransferTotals(0, 0.0), 0.0
        for engine, now in after.transfers.items():
            then = before.transfers.get(engine, TransferTotals(0, 0.0))
            restarted = now.reads < then.reads
            moved += now if restarted else now - then
            failed_then = 0.0 if restarted else before.failed_reads.get(engine, 0.0)
            failed += after.failed_reads.get(engine, 0.0) - failed_then
        mean = f"{1000 * moved.seconds / moved.reads:.1f}" if moved.reads else "-"
        lines.append(
            f"| {third} | {after.stalls - before.stalls:.0f} | "
            f"{after.fallbacks - before.fallbacks:.0f} | {moved.reads} | {mean} | {failed:.0f} |"
        )
    return lines


def reuse_around_restarts(turns: list[Turn], kills: list[Kill]) -> list[str]:
    """Per restart, the share of follow-up turns that reused KV in the ``REUSE_WINDOW_S`` before
    the kill and in as long from ``FALLBACK_WINDOW_S`` after the engine came back: whether a
    restarted engine is back in full use."""

    def share(since: float, until: float) -> str:
        window = [t for t in turns if t.index > 1 and since <= t.began < until]
        reused = sum(t.path == "reuse" for t in window)
        return f"{reused}/{len(window)}" + (f" ({reused / len(window):.0%})" if window else "")

    lines = []
    for kill in kills:
        if kill.back_after is None:
            continue
        back = kill.at + kill.back_after + FALLBACK_WINDOW_S
        lines.append(
            f"{kill.engine} killed at {kill.at:.0f} s: follow-ups reused "
            f"{share(kill.at - REUSE_WINDOW_S, kill.at)} before, "
            f"{share(back, back + REUSE_WINDOW_S)} after its return + {FALLBACK_WINDOW_S:g} s"
        )
    return lines


def report(outcome: Outcome) -> str:
    config, tally = outcome.config, outcome.tally
    settings = ", ".join(f"{key}={value}" for key, value in config.connector_settings)
    lines = [
        f"\n## soak: {config.minutes:g} min, {config.sessions} sessions, 1P2D, a kill "
        + (f"{config.kill_every_s:g} s after each restart" if config.kill_every_s else "never"),
    ]
    if settings:
        lines.append(f"connector settings: {settings}")
    lines += [
        f"turns sent {tally.sent}, answered {outcome.answered}, lost {outcome.lost}",
        (
            f"oracle sample: {tally.checked} checked, {tally.correct} correct ({tally.swaps_at_cut}"
            f" of them with a swap at the top-{TOP_K} cut within tolerance)"
        ),
    ]
    lines += [f"  WRONG: {failure.describe()}" for failure in tally.failures]
    if tally.failures:
        lines.append(f"  (prompts in {config.log_dir / 'oracle-failures.jsonl'})")
    lines += [
        "",
        "| kv path | first third p50 / p99 s (n) | last third p50 / p99 s (n) |",
        "|---|---|---|",
    ]
    first, last = outcome.third(0), outcome.third(2)
    for path in [*sorted({turn.path for turn in tally.turns}), None]:
        a = [t.seconds for t in first if path in (None, t.path)]
        b = [t.seconds for t in last if path in (None, t.path)]
        lines.append(f"| {path or 'all'} | {percentiles(a)} | {percentiles(b)} |")
    lines += ["", *thirds_table(tally.samples)]
    lines.append("\nkills: " + ("; ".join(k.describe() for k in tally.kills) or "none"))
    lines += [f"  {line}" for line in reuse_around_restarts(tally.turns, tally.kills)]
    reads = "; ".join(
        f"{r.count:.0f} on {r.engine} in {r.since:.0f}-{r.until:.0f} s"
        + (" (near a kill)" if r.near(tally.kills) else "")
        for r in tally.failed_reads
    )
    lines.append(f"failed KV reads: {reads or 'none'}")
    lines.append(f"errors: {dict(tally.errors) or 'none'}")
    lines += [
        "",
        "| process | serving from s | RSS at start MiB | RSS at end MiB |",
        "|---|---|---|---|",
    ]
    for rss in sorted(tally.rss.values(), key=lambda r: (r.name, r.started_at)):
        end = "killed" if rss.end is None else f"{rss.end:.0f}"
        lines.append(f"| {rss.name} | {rss.started_at:.0f} | {rss.start:.0f} | {end} |")
    series = ", ".join(f"{at:.0f}s:{held}" for at, held in tally.holdings)
    lines.append(f"\nholdings held over time: {series}")
    lines += ["", "| criterion | bound | measured | verdict |", "|---|---|---|---|"]
    for c in outcome.criteria().values():
        verdict = "pass" if c.passed else "FAIL"
        lines.append(f"| {c.name} | {c.bound} | {c.measured} | {verdict} |")
    return "\n".join(lines)
