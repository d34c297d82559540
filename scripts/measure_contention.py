#!/usr/bin/env python
"""What NIXL's polling threads and the engines' idle loops cost on a small CPU machine.

Starts ``agentkv serve``'s layout (router, one prefill and one decode engine, one core each)
once per connector setting: upstream behaviour (no thread demotion, no idle pacing), threads
demoted, demoted and paced, and paced only (the defaults). In each, runs sessions of token-id turns through the router
(which always pulls, so that every follow-up takes the KV path), then measures the CPU the
engines use for 10 s while the decode engine holds the sessions. docs/connector.md has results.

    .venv/bin/python scripts/measure_contention.py                  # 3 sessions x 3 turns, 2k
    .venv/bin/python scripts/measure_contention.py --history 4000 --sessions 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

import agentkv
from agentkv_server import wire
from agentkv_server.bundle.launcher import AGENTKV_CONNECTOR, ConnectorSpec
from agentkv_server.bundle.stack import Stack, StackConfig

ALWAYS_PULL = {"policy": "always"}
SETTINGS = {
    "upstream behaviour": {
        wire.EXTRA_DEMOTE_TRANSFER_THREADS: False,
        wire.EXTRA_IDLE_SLEEP_MS: 0,
        wire.EXTRA_NIXL_PROGRESS_DELAY_US: 0,
    },
    "threads demoted": {
        wire.EXTRA_DEMOTE_TRANSFER_THREADS: True,
        wire.EXTRA_IDLE_SLEEP_MS: 0,
        wire.EXTRA_NIXL_PROGRESS_DELAY_US: 0,
    },
    "demoted + paced": {wire.EXTRA_DEMOTE_TRANSFER_THREADS: True},
    "paced (defaults)": {},
}
NEW_TOKENS = 100
OUTPUT_TOKENS = 8
IDLE_WINDOW_S = 10.0


def complete(
    client: agentkv.OpenAI, model: str, prompt: list[int], session: agentkv.Session
) -> tuple[list[int], str, float]:
    """One token-id turn of ``session``: its output tokens, the router's KV path, its seconds."""
    began = time.monotonic()
    answer = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=OUTPUT_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    took = time.monotonic() - began
    path = session.last_turn.kv_path if session.last_turn else None
    return answer.choices[0].model_extra["token_ids"], path or "?", took


def cpu_seconds(stack: Stack) -> tuple[float, float]:
    """CPU seconds so far of the engines' engine-core processes, and of everything else."""
    core = other = 0.0
    for engine in stack.engines:
        assert engine.pid is not None
        root = psutil.Process(engine.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                seconds = times.user + times.system
                if "EngineCore" in process.name():
                    core += seconds
                else:
                    other += seconds
            except psutil.Error:
                continue
    return core, other


def measure(name: str, extra: dict[str, Any], args: argparse.Namespace) -> str:
    connector = ConnectorSpec(AGENTKV_CONNECTOR.name, AGENTKV_CONNECTOR.module_path, extra)
    config = StackConfig(
        model=args.model,
        port=0,
        log_dir=args.log_dir / name.split(" (")[0].replace(" ", "-").replace("+", "and"),
        connector=connector,
        router_settings=ALWAYS_PULL,
    )
    rng = random.Random(0)
    seconds: dict[str, list[float]] = {}
    with Stack(config) as stack:
        client = agentkv.OpenAI(base_url=f"{stack.endpoint}/v1", api_key="-")
        for index in range(args.sessions):
            prompt = [rng.randrange(10, 4000) for _ in range(args.history)]
            with agentkv.session(f"contention-{index}") as session:
                for _ in range(args.turns):
                    output, path, took = complete(client, stack.served_name, prompt, session)
                    seconds.setdefault(path, []).append(took)
                    prompt += output + [rng.randrange(10, 4000) for _ in range(NEW_TOKENS)]
        before = cpu_seconds(stack)
        time.sleep(IDLE_WINDOW_S)
        after = cpu_seconds(stack)
    medians = ", ".join(
        f"{path} {statistics.median(s):.3f} s" for path, s in sorted(seconds.items())
    )
    core, other = ((b - a) / IDLE_WINDOW_S for a, b in zip(before, after))
    return f"| {name} | {medians} | {core:.2f} cores | {other:.2f} cores |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--history", type=int, default=2000, help="tokens before turn 1")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--log-dir", type=Path, default=Path(".agentkv/contention"))
    parser.add_argument(
        "--setting",
        action="append",
        choices=sorted(SETTINGS),
        help="measure only these connector settings (repeatable; default: all)",
    )
    args = parser.parse_args()
    print("| connector | median turn by router path | engine-core loops, idle | everything else |")
    print("|---|---|---|---|")
    for name in args.setting or SETTINGS:
        print(measure(name, SETTINGS[name], args), flush=True)


if __name__ == "__main__":
    main()
