"""How long a prefill engine takes to answer a pull from a decode holder that was SIGKILLed,
and whether the surviving decode engine keeps serving (docs/faults.md, "A pull from a dead holder").

Starts 1 P + 2 D engines of the tiny model with no router (the steps are driven by hand, as
the router would drive them), holds a turn on D0, kills D0's process group, then times:
P's step pulling D0's holding (twice: the second meets a quarantined peer), checking each
answer against P's recompute of the same prompt (the oracle of docs/engines.md), and a cold turn
P -> D1 (D1 pulls from P). Run it under the machine's engine lock:

    flock /tmp/agentkv-engines.lock timeout 900 .venv/bin/python scripts/measure_dead_holder.py
"""

from __future__ import annotations

import argparse
import random
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.testing.probe import LOGPROB_TOLERANCE, EngineClient, KVProbe, logprob_gap

OUTPUT_TOKENS = 16
T = TypeVar("T")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def timed(label: str, step: Callable[[], T]) -> T | None:
    started = time.perf_counter()
    try:
        result = step()
    except OSError as exc:
        print(f"{label}: failed after {time.perf_counter() - started:.2f} s ({exc})")
        return None
    print(f"{label}: {time.perf_counter() - started:.2f} s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--log-dir", type=Path, default=Path(".agentkv/dead-holder-logs"))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    args = parser.parse_args()
    config = StackConfig(model="tiny", decode=2, router=False, port=0, log_dir=args.log_dir)
    rng = random.Random(0)
    with Stack(config) as stack:
        (p,), (d0, d1) = stack.prefill, stack.decode
        client = {
            e.name: EngineClient(e.url, stack.served_name, timeout=args.timeout)
            for e in stack.engines
        }
        to_d0 = KVProbe(client[p.name], client[d0.name])
        to_d1 = KVProbe(client[p.name], client[d1.name])
        first = tokens(rng, args.history)
        _, held = to_d0.turn(first, max_tokens=OUTPUT_TOKENS, retention_seconds=600)
        prompt = first + held.token_ids + tokens(rng, 100)
        timed("pull from the live holder (reference)", lambda: to_d0.prefill(prompt, held.holding,
              cache_salt="live"))  # fmt: skip
        d0.kill()
        killed_at = time.perf_counter()
        print(f"killed {d0.name}")
        for attempt in ("first", "second"):
            step = timed(f"P's step pulling from the dead holder ({attempt})",
                         lambda a=attempt: to_d0.prefill(prompt, held.holding, cache_salt=a))  # fmt: skip
            since_kill = time.perf_counter() - killed_at
            if step is not None:
                gap = logprob_gap(step.top_logprobs, to_d0.recomputed_logprobs(prompt))
                verdict = "correct" if gap < LOGPROB_TOLERANCE else "WRONG"
                print(f"  pulled {step.pulled_tokens} tokens; {verdict} (gap {gap:.1e} nats); "
                      f"answered {since_kill:.2f} s after the kill")  # fmt: skip
        timed("cold turn P -> surviving D1", lambda: to_d1.turn(tokens(rng, args.history),
              max_tokens=OUTPUT_TOKENS, retention_seconds=0))  # fmt: skip
        for engine in (p, d1):
            print(f"{engine.name} healthy at the end: {healthy(engine.url)}")
        print(f"P log: {stack.log_paths.get(p.name)}")


if __name__ == "__main__":
    main()
