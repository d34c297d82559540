"""What slicing a local prefill costs the follow-up and saves the sequences decoding beside it.

For each slice size (vLLM's ``--long-prefill-token-threshold`` on a decode engine; 0: one step),
one decode engine of the default model starts on core 1; DECODERS sequences stream long
answers; FOLLOWUPS follow-ups arrive one after another, each a prefix hit on a cached history
plus NEW new tokens. Printed per size (one JSON line): the follow-ups' TTFT, the decoders' gap
median outside the follow-ups, their gaps while a follow-up prefilled (mean, max), and the
excess over the median per follow-up and decoder. docs/router.md, "The local path on a busy
holder", has the run behind ``local.slice_tokens``' default.

    taskset -c 0 .venv/bin/python scripts/local_slices.py --slices 0,16,32,64,128
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from agentkv_server.bundle.launcher import EngineProcess, EngineSpec
from agentkv_server.bundle.model import resolve_model
from agentkv_server.bundle.ports import free_ports

DECODERS = 2
FOLLOWUPS = 5


async def stream(client: httpx.AsyncClient, url: str, body: dict, times: list[float]) -> None:
    """Stream a completion, noting when each chunk arrives."""
    body = {**body, "stream": True, "ignore_eos": True, "temperature": 0}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter())


async def first_token_s(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int]
) -> tuple[float, float]:
    """(sent, first token) of a one-token answer to ``prompt``."""
    times: list[float] = []
    sent = time.perf_counter()
    await stream(client, url, {"model": model, "prompt": prompt, "max_tokens": 1}, times)
    return sent, times[0]


def tokens(seed: int, count: int) -> list[int]:
    return [100 + (seed * 7919 + i * 13) % 20000 for i in range(count)]


async def measure(url: str, model: str, history_tokens: int, new_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        history = tokens(0, history_tokens)
        await first_token_s(client, url, model, history)  # into the prefix cache
        idle = [await first_token_s(client, url, model, history + tokens(1 + k, new_tokens))
                for k in range(3)]  # fmt: skip
        decodes: list[list[float]] = [[] for _ in range(DECODERS)]
        body = {"model": model, "max_tokens": 4000}
        decoders = [
            asyncio.create_task(stream(client, url, {**body, "prompt": tokens(50 + d, 64)}, times))
            for d, times in enumerate(decodes)
        ]
        await asyncio.sleep(4.0)
        windows = []
        for k in range(FOLLOWUPS):
            windows.append(
                await first_token_s(client, url, model, history + tokens(9 + k, new_tokens))
            )
            await asyncio.sleep(2.0)
        for task in decoders:
            task.cancel()
        await asyncio.gather(*decoders, return_exceptions=True)
    during, outside = [], []
    for times in decodes:
        for a, b in itertools.pairwise(times):
            inside = any(a < first and b > sent for sent, first in windows)
            if inside:
                during.append(b - a)
            elif a > windows[0][0] - 3.0:
                outside.append(b - a)
    median = statistics.median(outside)
    return {
        "idle_ttft_s": statistics.median(first - sent for sent, first in idle),
        "ttft_s": statistics.median(first - sent for sent, first in windows),
        "gap_median_s": median,
        "gap_during_mean_s": statistics.mean(during),
        "gap_during_max_s": max(during),
        "excess_per_followup_s": sum(max(g - median, 0) for g in during) / FOLLOWUPS / DECODERS,
    }


def run(slice_tokens: int, history_tokens: int, new_tokens: int, log_dir: Path) -> dict:
    model_dir, served = resolve_model(None, dtype="float32")
    port, side_channel_port = free_ports(2, "127.0.0.1")
    args = ("--long-prefill-token-threshold", str(slice_tokens)) if slice_tokens else ()
    spec = EngineSpec(
        role="decode",
        model=model_dir,
        served_name=served,
        port=port,
        side_channel_port=side_channel_port,
        log_path=log_dir / f"decode-slice-{slice_tokens}.log",
        cores="1",
        engine_args=args,
    )
    with EngineProcess(spec) as engine:
        engine.start()
        engine.wait_healthy(300)
        figures = asyncio.run(measure(spec.url, served, history_tokens, new_tokens))
    return {"slice_tokens": slice_tokens, **{k: round(v, 4) for k, v in figures.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", default="0,16,32,64,128", help="slice sizes, 0: unsliced")
    parser.add_argument("--history-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=160)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="local-slices-"))
    for size in (int(s) for s in args.slices.split(",")):
        print(json.dumps(run(size, args.history_tokens, args.new_tokens, log_dir)), flush=True)


if __name__ == "__main__":
    main()
