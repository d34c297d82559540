#!/usr/bin/env python
"""What an idle stack costs: each engine's CPU once the turns stop, and the turns around it.

Starts ``agentkv serve``'s layout (router, one prefill and one decode engine, tiny model, router
always pulling), runs sessions of token-id turns through the router, waits ``--idle`` seconds,
then samples each engine's whole process tree for ``--window`` seconds and prints its share of
one core with its busiest threads. Then each session sends one more turn (a pull from the decode
engine that held it through the idle time) and the script prints turn times by router path.
docs/connector.md has results.

    .venv/bin/python scripts/measure_idle.py                       # 2 sessions, 60 s idle
    .venv/bin/python scripts/measure_idle.py --idle 20 --extra '{"agentkv_idle_sleep_ms": 0}'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import agentkv
from agentkv_server.bundle.launcher import AGENTKV_CONNECTOR, ConnectorSpec
from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.testing.cpu_usage import sample_group_cpu

ALWAYS_PULL = {"policy": "always"}
NEW_TOKENS = 100
OUTPUT_TOKENS = 8


class Session:
    """One token-id conversation through the router; records each turn's seconds by path."""

    def __init__(self, name: str, history: int, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self.prompt = [rng.randrange(10, 4000) for _ in range(history)]

    def turn(self, client: agentkv.OpenAI, model: str, seconds: dict[str, list[float]]) -> None:
        with agentkv.session(self.name) as session:
            began = time.monotonic()
            answer = client.completions.create(
                model=model,
                prompt=self.prompt,
                max_tokens=OUTPUT_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            took = time.monotonic() - began
            path = (session.last_turn.kv_path if session.last_turn else None) or "?"
        seconds.setdefault(path, []).append(took)
        output = answer.choices[0].model_extra["token_ids"]
        self.prompt += output + [self.rng.randrange(10, 4000) for _ in range(NEW_TOKENS)]


def medians(seconds: dict[str, list[float]]) -> str:
    return ", ".join(
        f"{path} {statistics.median(s):.3f} s (n={len(s)})" for path, s in sorted(seconds.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--history", type=int, default=2000, help="tokens before turn 1")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--idle", type=float, default=60.0, help="seconds before sampling")
    parser.add_argument("--window", type=float, default=15.0, help="seconds sampled")
    parser.add_argument("--extra", default="{}", help="kv_connector_extra_config, as JSON")
    parser.add_argument("--log-dir", type=Path, default=Path(".agentkv/idle"))
    args = parser.parse_args()

    connector = ConnectorSpec(
        AGENTKV_CONNECTOR.name, AGENTKV_CONNECTOR.module_path, json.loads(args.extra)
    )
    config = StackConfig(
        model=args.model,
        port=0,
        log_dir=args.log_dir,
        connector=connector,
        router_settings=ALWAYS_PULL,
    )
    rng = random.Random(0)
    busy: dict[str, list[float]] = {}
    after_idle: dict[str, list[float]] = {}
    with Stack(config) as stack:
        client = agentkv.OpenAI(base_url=f"{stack.endpoint}/v1", api_key="-")
        sessions = [Session(f"idle-{i}-{time.time_ns()}", args.history, rng)
                    for i in range(args.sessions)]  # fmt: skip
        for session in sessions:
            for _ in range(args.turns):
                session.turn(client, stack.served_name, busy)
        time.sleep(args.idle)
        groups = {engine.name: engine.pid for engine in stack.engines if engine.pid}
        usage = sample_group_cpu(groups, args.window)
        for session in sessions:
            session.turn(client, stack.served_name, after_idle)
    print(f"extra config {args.extra}; {args.idle:.0f} s idle, then {args.window:.0f} s sampled")
    for name, cpu in usage.items():
        print(f"{name}: {100 * cpu.cores:.1f} % of a core; busiest threads: {cpu.busiest()}")
    print(f"turns before the idle time: {medians(busy)}")
    print(f"turns after it:             {medians(after_idle)}")


if __name__ == "__main__":
    main()
