#!/usr/bin/env python
"""Soak: the real stack under concurrent agent sessions while engines die and come back.

Starts 1P2D (router, one prefill and two decode engines), then for ``--minutes`` runs
``--sessions`` concurrent agent sessions through the agentkv SDK: token-id turns whose history
grows by the answer plus a tool result, a random tool gap between turns, every
``--stream-every``-th turn streamed, a fresh session after ``--turns`` turns. Every
``--kill-every`` seconds a random engine is SIGKILLed and started again on its ports, under a
fresh NIXL engine id as a supervisor would (``--same-engine-id``: its old one). A sample
of non-streamed turns (every ``--oracle-every``-th) is checked by the oracle: first-token top-5
logprobs against a recompute from scratch (docs/engines.md); each failed check is printed in
full and written, with its prompt, to ``<log dir>/oracle-failures.jsonl``. Before a restart
the soak waits up to ``PORTS_FREE_WAIT_S`` for the engine's ports (the router knows engines by
address); a port still held fails that restart, naming its holder, and the kills go on.
Prints turns sent / answered / correct, p50/p99 turn time per KV path in the first and last
third, per third the router's pull stalls and fallback turns and the engines' KV transfer time,
the errors, each process tree's RSS at start and end, and the router's holdings over time.
``--connector-setting KEY=VALUE`` adds to the engines' ``kv_connector_extra_config``.
docs/faults.md has results.

Starts engines: run it under the machine's engine lock, e.g.

    flock /tmp/agentkv-engines.lock timeout 900 .venv/bin/python scripts/soak.py --minutes 3
    .venv/bin/python scripts/soak.py --minutes 30 --kill-every 180      # the long soak
    .venv/bin/python scripts/soak.py --connector-setting agentkv_demote_transfer_threads=false
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import random
import statistics
import time
import urllib.request
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

TOP_K = 5
HOLDINGS_EVERY_S = 10.0
# A killed engine's ports can stay held a while by its dying processes; the first soak's fourth
# restart found one taken at once (docs/faults.md).
PORTS_FREE_WAIT_S = 60.0
STALLS = ("agentkv_engine_errors_total", 'kind="stall"')
FALLBACKS = ("agentkv_turns_total", 'path="fallback"')
# Reads the connector abandoned (past their deadline, or their peer failed) or NIXL failed.
FAILED_READS = "vllm:nixl_num_failed_transfers_total"


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


@dataclass
class Tally:
    sent: int = 0
    turns: list[Turn] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    checked: int = 0
    correct: int = 0
    swaps_at_cut: int = 0  # correct, with top-k sets that differ by a swap within tolerance
    failures: list[OracleFailure] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    holdings: list[tuple[float, int]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


class Soak:
    def __init__(self, stack: Stack, args: argparse.Namespace) -> None:
        self.stack = stack
        self.args = args
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.started = time.monotonic()
        self.deadline = self.started + args.minutes * 60
        self.client = agentkv.AsyncOpenAI(
            base_url=f"{stack.endpoint}/v1", api_key="-", timeout=args.turn_timeout
        )

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 4000) for _ in range(n)]

    async def run(self) -> None:
        workers = [self.agent(index) for index in range(self.args.sessions)]
        self.tally.samples.append(await asyncio.to_thread(self.sample))
        await asyncio.gather(*workers, self.chaos(), self.watch_holdings(), self.watch_thirds())
        self.tally.samples.append(await asyncio.to_thread(self.sample))

    async def agent(self, index: int) -> None:
        generation = 0
        while time.monotonic() < self.deadline:
            generation += 1
            prompt = self.tokens(self.args.history)
            name = f"soak-{index}-{generation}"
            async with agentkv.session(name) as session:
                for turn in range(self.args.turns):
                    if time.monotonic() >= self.deadline:
                        return
                    if turn == self.args.turns - 1:
                        session.end_next_turn()
                    output = await self.turn(session, (name, turn + 1), prompt)
                    if output is None:
                        break  # a lost turn: the agent starts over
                    prompt = prompt + output + self.tokens(self.args.new_tokens)
                    await asyncio.sleep(self.rng.uniform(0, self.args.max_tool_gap))

    async def turn(
        self, session: agentkv.Session, where: tuple[str, int], prompt: list[int]
    ) -> list[int] | None:
        """One turn; its output token ids, or None when it was not answered."""
        tally = self.tally
        tally.sent += 1
        streamed = tally.sent % self.args.stream_every == 0
        checked = not streamed and tally.sent % self.args.oracle_every == 0
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
        self.args.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.args.log_dir / "oracle-failures.jsonl").open("a") as log:
            log.write(json.dumps(dataclasses.asdict(failure)) + "\n")

    def create(self, prompt: list[int], **options: Any) -> Any:
        return self.client.completions.create(
            model=self.stack.served_name,
            prompt=prompt,
            max_tokens=self.args.output_tokens,
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
        if len(output) != self.args.output_tokens:
            raise RuntimeError(f"stream ended after {len(output)} tokens")
        return output

    def oracle(self, prompt: list[int], got: dict[str, float]) -> Verdict | None:
        """The first token's top-k logprobs recomputed on any engine that is up; None (an
        error) when none answered."""
        for engine in self.stack.engines:
            client = EngineClient(engine.url, self.stack.served_name, timeout=120)
            try:
                wanted = KVProbe(client, client, top_k=TOP_K).recomputed_logprobs(prompt)
            except OSError:
                continue  # killed or restarting: try another
            return Verdict(logprob_gap(got, wanted), wanted, engine.name)
        self.tally.errors["oracle: no engine answered"] += 1
        return None

    async def chaos(self) -> None:
        """Kill a random engine every ``--kill-every`` seconds (0: never) and start it again."""
        while self.args.kill_every > 0:
            await asyncio.sleep(self.args.kill_every)
            if time.monotonic() >= self.deadline - 30:
                return
            await self.kill_and_restart(self.rng.randrange(len(self.stack.engines)))

    async def kill_and_restart(self, index: int) -> None:
        """SIGKILL engine ``index`` and start it again on its ports; a failed restart is an
        error, and that engine stays down until a later kill picks it again."""
        victim = self.stack.engines[index]
        at = time.monotonic() - self.started
        victim.kill()
        began = time.monotonic()
        # A supervisor restarts an engine under a new NIXL engine id (docs/deploy.md);
        # --same-engine-id restarts it under its old one.
        spec = victim.spec
        if not self.args.same_engine_id:
            spec = dataclasses.replace(spec, fresh_engine_id=True)
        replacement = EngineProcess(spec)
        self.stack.engines[index] = replacement
        try:
            await asyncio.to_thread(wait_ports_free, victim.spec, PORTS_FREE_WAIT_S)
            freed = time.monotonic() - began
            await asyncio.to_thread(replacement.start)
            await asyncio.to_thread(replacement.wait_healthy, 600)
        except Exception as exc:  # noqa: BLE001 - a failed restart is a finding, not a crash
            self.tally.errors[f"restart of {victim.name}: {str(exc).splitlines()[0]}"] += 1
            self.tally.kills.append(f"{at:.0f} s: killed {victim.name}, restart FAILED")
            return
        took = time.monotonic() - began
        self.tally.kills.append(
            f"{at:.0f} s: killed {victim.name}, ports free after {freed:.0f} s, back in {took:.0f} s"
        )

    async def watch_thirds(self) -> None:
        """Sample the counters as the second and the last third begin."""
        third = self.args.minutes * 60 / 3
        for at in (third, 2 * third):
            await asyncio.sleep(max(0.0, self.started + at - time.monotonic()))
            self.tally.samples.append(await asyncio.to_thread(self.sample))

    def sample(self) -> Sample:
        router = scrape(self.stack.endpoint)
        transfers, failed_reads = {}, {}
        for engine in self.stack.engines:
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
            self.tally.holdings.append((time.monotonic() - self.started, held))
            await asyncio.sleep(HOLDINGS_EVERY_S)

    def sessions_held(self) -> int:
        text = scrape(self.stack.endpoint)
        return -1 if text is None else round(total(text, "agentkv_sessions_held"))


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


def rss_mib(processes: list[ManagedProcess]) -> dict[str, float]:
    """Each managed process tree's resident memory, MiB."""
    sizes: dict[str, float] = {}
    for process in processes:
        if process.pid is None:
            continue
        try:
            root = psutil.Process(process.pid)
            tree = [root, *root.children(recursive=True)]
            sizes[process.name] = sum(p.memory_info().rss for p in tree) / 2**20
        except psutil.Error:
            sizes[process.name] = float("nan")
    return sizes


def percentiles(seconds: list[float]) -> str:
    if not seconds:
        return "-"
    if len(seconds) == 1:
        return f"{seconds[0]:.2f} / {seconds[0]:.2f} (1)"
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return f"{statistics.median(seconds):.2f} / {cuts[98]:.2f} ({len(seconds)})"


def print_thirds(samples: list[Sample]) -> None:
    """Per third: the router's pull stalls and fallback turns, the engines' KV transfers and
    failed or abandoned reads. An engine restarted within a third counts only its transfers
    since the restart."""
    print(
        "\n| third | pull stalls | fallback turns | KV transfers | mean transfer ms | failed reads |"
    )
    print("|---|---|---|---|---|---|")
    for third, (before, after) in enumerate(itertools.pairwise(samples), start=1):
        moved, failed = TransferTotals(0, 0.0), 0.0
        for engine, now in after.transfers.items():
            then = before.transfers.get(engine, TransferTotals(0, 0.0))
            restarted = now.reads < then.reads
            moved += now if restarted else now - then
            failed_then = 0.0 if restarted else before.failed_reads.get(engine, 0.0)
            failed += after.failed_reads.get(engine, 0.0) - failed_then
        mean = f"{1000 * moved.seconds / moved.reads:.1f}" if moved.reads else "-"
        print(
            f"| {third} | {after.stalls - before.stalls:.0f} | "
            f"{after.fallbacks - before.fallbacks:.0f} | {moved.reads} | {mean} | {failed:.0f} |"
        )


def report(soak: Soak, rss_start: dict[str, float], rss_end: dict[str, float]) -> None:
    tally, minutes = soak.tally, soak.args.minutes
    answered = len(tally.turns)
    settings = ", ".join(f"{key}={value}" for key, value in soak.args.connector_setting)
    print(f"\n## soak: {minutes:g} min, {soak.args.sessions} sessions, 1P2D")
    if settings:
        print(f"connector settings: {settings}")
    print(f"turns sent {tally.sent}, answered {answered}, lost {tally.sent - answered}")
    print(
        f"oracle sample: {tally.checked} checked, {tally.correct} correct "
        f"({tally.swaps_at_cut} of them with a swap at the top-{TOP_K} cut within tolerance)"
    )
    for failure in tally.failures:
        print(f"  WRONG: {failure.describe()}")
    if tally.failures:
        print(f"  (prompts in {soak.args.log_dir / 'oracle-failures.jsonl'})")
    third = minutes * 60 / 3
    print("\n| kv path | first third p50 / p99 s (n) | last third p50 / p99 s (n) |")
    print("|---|---|---|")
    for path in sorted({turn.path for turn in tally.turns}):
        first = [t.seconds for t in tally.turns if t.path == path and t.began < third]
        last = [t.seconds for t in tally.turns if t.path == path and t.began >= 2 * third]
        print(f"| {path} | {percentiles(first)} | {percentiles(last)} |")
    print_thirds(tally.samples)
    print("\nkills:", "; ".join(tally.kills) or "none")
    print("errors:", dict(tally.errors) or "none")
    print("\n| process | RSS at start MiB | RSS at end MiB |")
    print("|---|---|---|")
    for name in sorted(rss_start.keys() | rss_end.keys()):
        print(f"| {name} | {rss_start.get(name, 0):.0f} | {rss_end.get(name, 0):.0f} |")
    series = ", ".join(f"{at:.0f}s:{held}" for at, held in tally.holdings)
    print(f"\nholdings held over time: {series}")


async def soak(stack: Stack, args: argparse.Namespace) -> None:
    processes = [*stack.engines, *([stack.router] if stack.router else [])]
    rss_start = rss_mib(processes)
    run = Soak(stack, args)
    await run.run()
    processes = [*stack.engines, *([stack.router] if stack.router else [])]
    report(run, rss_start, rss_mib(processes))


def connector_setting(text: str) -> tuple[str, bool | int | float | str]:
    """``KEY=VALUE``, the value as JSON would type it: true/false, an int, a float, else text."""
    key, equals, raw = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6, help="turns per agent session")
    parser.add_argument("--history", type=int, default=400, help="tokens before turn 1")
    parser.add_argument("--new-tokens", type=int, default=100, help="tool result per turn")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--max-tool-gap", type=float, default=3.0, help="seconds, uniform")
    parser.add_argument("--stream-every", type=int, default=3)
    parser.add_argument("--oracle-every", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds; 0: no kills")
    parser.add_argument(
        "--same-engine-id",
        action="store_true",
        help="restart a killed engine under its old NIXL engine id (default: a fresh one)",
    )
    parser.add_argument("--turn-timeout", type=float, default=300.0)
    parser.add_argument("--policy", default="always", help="the router's (always: every pull)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path(".agentkv/soak"))
    parser.add_argument(
        "--connector-setting",
        type=connector_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="into the engines' kv_connector_extra_config (true/false, numbers parsed); repeatable",
    )
    args = parser.parse_args()
    extra_config = {**AGENTKV_CONNECTOR.extra_config, **dict(args.connector_setting)}
    config = StackConfig(
        model=args.model,
        port=0,
        decode=2,
        log_dir=args.log_dir,
        router_settings={"policy": args.policy},
        connector=dataclasses.replace(AGENTKV_CONNECTOR, extra_config=extra_config),
    )
    with Stack(config) as stack:
        asyncio.run(soak(stack, args))


if __name__ == "__main__":
    main()
