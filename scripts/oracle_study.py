#!/usr/bin/env python
"""Is KV pulled from a decode engine the same as KV recomputed? (docs/engines.md, the oracle)

Starts one prefill and one decode engine of a test model, then for each of ``--trials``
conversations: turn 1 on P then D; the follow-up prompt (turn 1 + its output + new tokens)
once through a pull of D's holding, once recomputed from scratch, once through a pull of a
*different* conversation's holding of the same length (wrong KV, let past prefix verification
with a forged fingerprint). Prints, per path, the largest top-5 first-token logprob gap to the
recompute and whether the greedy token differs.

    .venv/bin/python scripts/oracle_study.py --dtype float32
    .venv/bin/python scripts/oracle_study.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from agentkv_server import wire
from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.connector import PrefixFingerprint
from agentkv_server.testing.probe import EngineClient, KVProbe, PrefillStep

# 2000 + 49 - 1 = 2048 held tokens: 16 whole CPU blocks (128 tokens), so D's own prefix cache
# covers exactly the tokens a pull copies and D's local answer is comparable bit for bit.
HISTORY, NEW, OUTPUT = 2000, 60, 49


def tokens(seed: int, n: int, vocab: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def greedy(step: PrefillStep | dict[str, float]) -> str:
    logprobs = step.top_logprobs if isinstance(step, PrefillStep) else step
    return max(logprobs, key=logprobs.__getitem__)


def common_gap(got: dict[str, float], want: dict[str, float]) -> float:
    """Largest gap over the tokens both top-5s contain (the sets may differ near a tie)."""
    return max((abs(got[t] - want[t]) for t in got.keys() & want.keys()), default=float("inf"))


def trial(probe: KVProbe, seed: int) -> dict[str, float]:
    a, b = tokens(seed, HISTORY), tokens(seed + 1, HISTORY)
    _, held_a = probe.turn(a, max_tokens=OUTPUT, retention_seconds=300)
    _, held_b = probe.turn(b, max_tokens=OUTPUT, retention_seconds=300)
    follow_up = a + held_a.token_ids + tokens(seed + 2, NEW)
    recomputed = probe.recomputed_logprobs(follow_up)
    held = follow_up[: held_a.holding[wire.REMOTE_NUM_TOKENS]]
    forged = {
        **held_b.holding,
        **PrefixFingerprint.of(held, held_a.holding[wire.HASH_BLOCK_SIZE]).to_params(),
    }
    local = probe.decode_engine_logprobs(follow_up)
    reuse = probe.prefill(follow_up, held_a.holding, cache_salt=f"r{time.time_ns()}")
    wrong = probe.prefill(follow_up, forged, cache_salt=f"w{time.time_ns()}")
    top = sorted(recomputed.values(), reverse=True)
    return {
        "reuse_vs_local": common_gap(reuse.top_logprobs, local.top_logprobs),
        "local_gap": common_gap(local.top_logprobs, recomputed),
        "local_hits": local.local_hit_tokens,
        "reuse_gap": common_gap(reuse.top_logprobs, recomputed),
        "reuse_same_top5": reuse.top_logprobs.keys() == recomputed.keys(),
        "reuse_flip": greedy(reuse) != greedy(recomputed),
        "wrong_gap": common_gap(wrong.top_logprobs, recomputed),
        "wrong_same_top5": wrong.top_logprobs.keys() == recomputed.keys(),
        "wrong_flip": greedy(wrong) != greedy(recomputed),
        "top1_margin": top[0] - top[1],
        "pulled": reuse.pulled_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--log-dir", type=Path, default=Path(".agentkv/oracle-logs"))
    args = parser.parse_args()
    config = StackConfig(model=args.model, dtype=args.dtype, router=False, log_dir=args.log_dir)
    with Stack(config) as stack:
        p, d = (EngineClient(e.url, stack.served_name) for e in (*stack.prefill, *stack.decode))
        probe = KVProbe(p, d)
        rows = [trial(probe, 1000 * i) for i in range(args.trials)]
    print(f"model {args.model} {args.dtype}, {HISTORY}-token history, {args.trials} trials")
    print(
        "| trial | pulled | reuse vs D's local hit | D's local hit vs recompute "
        "| reuse vs recompute: gap, same top-5, greedy flips "
        "| wrong KV vs recompute: gap, same top-5, greedy flips | top-1 margin |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, row in enumerate(rows):
        print(
            f"| {i} | {row['pulled']} | {row['reuse_vs_local']:.1e} "
            f"| {row['local_gap']:.1e} ({row['local_hits']} hit) "
            f"| {row['reuse_gap']:.1e}, {row['reuse_same_top5']}, {row['reuse_flip']} "
            f"| {row['wrong_gap']:.2g}, {row['wrong_same_top5']}, {row['wrong_flip']} "
            f"| {row['top1_margin']:.2g} |"
        )


if __name__ == "__main__":
    main()
