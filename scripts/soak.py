#!/usr/bin/env python
"""Soak: the real stack under concurrent agent sessions while engines die and come back.

Starts 1P2D (router, one prefill and two decode engines), then for ``--minutes`` runs
``--sessions`` concurrent agent sessions through the agentkv SDK: token-id turns whose history
grows by the answer plus a tool result, a random tool gap between turns, every
``--stream-every``-th turn streamed, a fresh session after ``--turns`` turns. Every
``--kill-every`` seconds a random engine is SIGKILLed and started again on its ports. A sample
of non-streamed turns (every ``--oracle-every``-th) is checked by the oracle: first-token top-5
logprobs against a recompute from scratch (docs/engines.md). Prints turns sent / answered /
correct, p50/p99 turn time per KV path in the first and last third, the errors, each process
tree's RSS at start and end, and the router's holdings over time. docs/faults.md has results.

Starts engines: run it under the machine's engine lock, e.g.

    flock /tmp/agentkv-engines.lock timeout 900 .venv/bin/python scripts/soak.py --minutes 3
    .venv/bin/python scripts/soak.py --minutes 30 --kill-every 180      # the long soak
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

import agentkv
from agentkv_server.bundle.launcher import EngineProcess
from agentkv_server.bundle.process import ManagedProcess
from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.testing.probe import LOGPROB_TOLERANCE, EngineClient, KVProbe, logprob_gap

TOP_K = 5
HOLDINGS_EVERY_S = 10.0


@dataclass
class Turn:
    began: float  # seconds since the soak started
    seconds: float
    path: str
    streamed: bool
    correct: bool | None = None  # None: not in the oracle's sample


@dataclass
class Tally:
    sent: int = 0
    turns: list[Turn] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    checked: int = 0
    correct: int = 0
    kills: list[str] = field(default_factory=list)
    holdings: list[tuple[float, int]] = field(default_factory=list)


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
        await asyncio.gather(*workers, self.chaos(), self.watch_holdings())

    async def agent(self, index: int) -> None:
        generation = 0
        while time.monotonic() < self.deadline:
            generation += 1
            prompt = self.tokens(self.args.history)
            async with agentkv.session(f"soak-{index}-{generation}") as session:
                for turn in range(self.args.turns):
                    if time.monotonic() >= self.deadline:
                        return
                    if turn == self.args.turns - 1:
                        session.end_next_turn()
                    output = await self.turn(session, prompt)
                    if output is None:
                        break  # a lost turn: the agent starts over
                    prompt = prompt + output + self.tokens(self.args.new_tokens)
                    await asyncio.sleep(self.rng.uniform(0, self.args.max_tool_gap))

    async def turn(self, session: agentkv.Session, prompt: list[int]) -> list[int] | None:
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
            began - self.started,
            time.monotonic() - began,
            (last.kv_path if last else None) or "?",
            streamed,
        )
        if checked and first_logprobs is not None:
            record.correct = await asyncio.to_thread(self.oracle, prompt, first_logprobs)
            tally.checked += 1
            tally.correct += bool(record.correct)
        tally.turns.append(record)
        return output

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

    def oracle(self, prompt: list[int], got: dict[str, float]) -> bool:
        """The first token's top-k logprobs equal a recompute on any engine that is up."""
        for engine in self.stack.engines:
            client = EngineClient(engine.url, self.stack.served_name, timeout=120)
            try:
                wanted = KVProbe(client, client, top_k=TOP_K).recomputed_logprobs(prompt)
            except OSError:
                continue  # killed or restarting: try another
            return logprob_gap(got, wanted) < LOGPROB_TOLERANCE
        self.tally.errors["oracle: no engine answered"] += 1
        return False

    async def chaos(self) -> None:
        """Kill a random engine every ``--kill-every`` seconds and start it again."""
        while True:
            await asyncio.sleep(self.args.kill_every)
            if time.monotonic() >= self.deadline - 30:
                return
            index = self.rng.randrange(len(self.stack.engines))
            victim = self.stack.engines[index]
            at = time.monotonic() - self.started
            victim.kill()
            began = time.monotonic()
            replacement = EngineProcess(victim.spec)
            self.stack.engines[index] = replacement
            try:
                await asyncio.to_thread(replacement.start)
                await asyncio.to_thread(replacement.wait_healthy, 600)
            except Exception as exc:  # noqa: BLE001 - a failed restart is a finding, not a crash
                self.tally.errors[f"restart of {victim.name}: {str(exc).splitlines()[0]}"] += 1
                return
            took = time.monotonic() - began
            self.tally.kills.append(f"{at:.0f} s: killed {victim.name}, back in {took:.0f} s")

    async def watch_holdings(self) -> None:
        while time.monotonic() < self.deadline:
            held = await asyncio.to_thread(self.sessions_held)
            self.tally.holdings.append((time.monotonic() - self.started, held))
            await asyncio.sleep(HOLDINGS_EVERY_S)

    def sessions_held(self) -> int:
        try:
            with urllib.request.urlopen(self.stack.endpoint + "/metrics", timeout=5) as answer:
                text = answer.read().decode()
        except OSError:
            return -1
        for line in text.splitlines():
            if line.startswith("agentkv_sessions_held "):
                return int(float(line.split()[1]))
        return -1


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


def report(soak: Soak, rss_start: dict[str, float], rss_end: dict[str, float]) -> None:
    tally, minutes = soak.tally, soak.args.minutes
    answered = len(tally.turns)
    print(f"\n## soak: {minutes:g} min, {soak.args.sessions} sessions, 1P2D")
    print(f"turns sent {tally.sent}, answered {answered}, lost {tally.sent - answered}")
    print(f"oracle sample: {tally.checked} checked, {tally.correct} correct")
    third = minutes * 60 / 3
    print("\n| kv path | first third p50 / p99 s (n) | last third p50 / p99 s (n) |")
    print("|---|---|---|")
    for path in sorted({turn.path for turn in tally.turns}):
        first = [t.seconds for t in tally.turns if t.path == path and t.began < third]
        last = [t.seconds for t in tally.turns if t.path == path and t.began >= 2 * third]
        print(f"| {path} | {percentiles(first)} | {percentiles(last)} |")
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
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds")
    parser.add_argument("--turn-timeout", type=float, default=300.0)
    parser.add_argument("--policy", default="always", help="the router's (always: every pull)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path(".agentkv/soak"))
    args = parser.parse_args()
    config = StackConfig(
        model=args.model,
        port=0,
        decode=2,
        log_dir=args.log_dir,
        router_settings={"policy": args.policy},
    )
    with Stack(config) as stack:
        asyncio.run(soak(stack, args))


if __name__ == "__main__":
    main()
