#!/usr/bin/env python
"""Time to first token of a follow-up turn: KV pulled from the decode engine vs recomputed.

Starts one prefill (P) and one decode (D) engine (agentkv connector, the ~100M ``small`` test
model by default) and, for each history size, repeats: turn 1 (history on P, then D, which
retains it); then the follow-up (history + turn 1's output + new tokens) as the router would
send it, once pulling D's holding and once recomputed. A fresh ``cache_salt`` per follow-up keeps
P's own prefix cache out of it, as for a session whose prefix P no longer caches. TTFT = P's
step + D's step to its first token. Also prints the engines' start time and memory.

    .venv/bin/python scripts/measure_reuse.py                      # small, bf16, 2k/4k/8k
    .venv/bin/python scripts/measure_reuse.py --history 2000 --repeats 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.testing.probe import EngineClient, KVProbe

NEW_TOKENS = 100
OUTPUT_TOKENS = 32


@dataclass(frozen=True)
class Sample:
    prefill_s: float
    ttft_s: float
    pulled: int


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


def follow_up(probe: KVProbe, prompt: Sequence[int], holding: dict | None, salt: str) -> Sample:
    """P's step (pulling ``holding`` if given), then D's step to its first token."""
    prefill = probe.prefill(prompt, holding, cache_salt=salt)
    decode = probe.decode(prompt, prefill, max_tokens=1, retention_seconds=0)
    return Sample(prefill.seconds, prefill.seconds + decode.seconds, prefill.pulled_tokens)


def measure(probe: KVProbe, history: int, repeats: int, rng: random.Random) -> dict[str, list]:
    samples: dict[str, list[Sample]] = {"reuse": [], "recompute": []}
    for _ in range(repeats):
        first = tokens(rng, history)
        _, held = probe.turn(first, max_tokens=OUTPUT_TOKENS, retention_seconds=600)
        prompt = first + held.token_ids + tokens(rng, NEW_TOKENS)
        samples["reuse"].append(follow_up(probe, prompt, held.holding, f"r{time.time_ns()}"))
        samples["recompute"].append(follow_up(probe, prompt, None, f"c{time.time_ns()}"))
    return samples


def memory_mib(pgid: int) -> tuple[float, float]:
    """RSS and PSS (shared pages split between sharers) of a process group, in MiB."""
    rss = pss = 0
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(status.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            rollup = (status.parent / "smaps_rollup").read_text().splitlines()
        except (OSError, IndexError, ValueError):
            continue
        fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:]}
        rss, pss = rss + fields["Rss"], pss + fields["Pss"]
    return rss / 1024, pss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--history", type=int, nargs="+", default=[2000, 4000, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-dir", type=Path, default=Path(".agentkv/measure-logs"))
    args = parser.parse_args()

    config = StackConfig(model=args.model, dtype=args.dtype, router=False, log_dir=args.log_dir)
    started = time.perf_counter()
    with Stack(config) as stack:
        start_s = time.perf_counter() - started
        memory = {engine.name: memory_mib(engine.pid or 0) for engine in stack.engines}
        p, d = (EngineClient(e.url, stack.served_name) for e in (*stack.prefill, *stack.decode))
        probe = KVProbe(p, d)
        rng = random.Random(0)
        results = {h: measure(probe, h, args.repeats, rng) for h in args.history}
        memory_after = {engine.name: memory_mib(engine.pid or 0) for engine in stack.engines}

    print(f"model {args.model} ({args.dtype}), medians of {args.repeats}, P step + D first token")
    print(
        "| history | pulled | TTFT reuse | TTFT recompute | ratio | P step reuse | P step recompute |"
    )
    print("|---|---|---|---|---|---|---|")
    for history, samples in results.items():
        reuse, recompute = samples["reuse"], samples["recompute"]
        ttft_reuse = statistics.median(s.ttft_s for s in reuse)
        ttft_recompute = statistics.median(s.ttft_s for s in recompute)
        print(
            f"| {history} | {statistics.median(s.pulled for s in reuse):.0f} "
            f"| {ttft_reuse:.2f} s | {ttft_recompute:.2f} s | {ttft_recompute / ttft_reuse:.1f}x "
            f"| {statistics.median(s.prefill_s for s in reuse):.2f} s "
            f"| {statistics.median(s.prefill_s for s in recompute):.2f} s |"
        )
    print(f"\nstack start (both engines, concurrently): {start_s:.0f} s")
    for name, (rss, pss) in memory.items():
        rss_after, pss_after = memory_after[name]
        print(
            f"{name}: RSS {rss:.0f} MiB, PSS {pss:.0f} MiB idle; "
            f"RSS {rss_after:.0f} MiB, PSS {pss_after:.0f} MiB after the runs"
        )


if __name__ == "__main__":
    main()
