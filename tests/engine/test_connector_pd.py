"""AgentKVConnector's own promises on real engines (docs/connector.md), on the session stack.

``probe`` plays the router's part by hand with token-id prompts, so shared and edited prefixes
are exact; the oracle (docs/engines.md) compares the fp32 model's first-token top-5 logprobs
after a pull with a full recompute. test_kv_reuse.py covers plain multi-turn reuse, expiry and
the oracle's negative control; these tests cover verification, retention, release and reports.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from typing import Any

import pytest

from agentkv_server.bundle.stack import Stack
from agentkv_server.testing.probe import LOGPROB_TOLERANCE, KVProbe, logprob_gap

pytestmark = pytest.mark.engine

NEW_TOKENS = 300  # D's output: long enough that held blocks reach past P's own cached prompt


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def edited(prompt: list[int], at: int) -> list[int]:
    copy = list(prompt)
    copy[at] = copy[at] % 3999 + 10  # another token id in the same range
    return copy


def whole_blocks(n: int, block: int) -> int:
    return n // block * block


def blocks_in_use(probe: KVProbe) -> float:
    """D's share of KV blocks owned by requests (retained ones included; cached free ones not)."""
    return probe.d.kv_usage()


def release(probe: KVProbe, *request_ids: str) -> None:
    """The router's release call (docs/protocol.md section 5)."""
    probe.d.complete(
        [11, 12], max_tokens=1, kv_transfer_params={"agentkv_release": list(request_ids)}
    )


def wait_until(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_edited_history_pulls_only_the_blocks_before_the_edit(probe: KVProbe) -> None:
    history = tokens(1, 600)
    _, turn1 = probe.turn(history, max_tokens=NEW_TOKENS, retention_seconds=120)
    block = turn1.holding["agentkv_hash_block_size"]
    edit_at = len(history) + 200  # in turn 1's output: past what P cached from turn 1's prompt
    follow_up = edited(history + turn1.token_ids + tokens(2, 40), edit_at)

    step = probe.prefill(follow_up, turn1.holding)

    # Upstream would load all held tokens, the edited one and everything after it included.
    assert step.local_hit_tokens == whole_blocks(len(history), block)
    assert step.pulled_tokens == whole_blocks(edit_at, block) - step.local_hit_tokens
    assert logprob_gap(step.top_logprobs, probe.recomputed_logprobs(follow_up)) < LOGPROB_TOLERANCE


def test_history_edited_near_its_start_pulls_nothing(probe: KVProbe) -> None:
    history = tokens(3, 600)
    _, turn1 = probe.turn(history, max_tokens=NEW_TOKENS, retention_seconds=120)
    follow_up = edited(history + turn1.token_ids + tokens(4, 40), 5)

    step = probe.prefill(follow_up, turn1.holding)

    assert step.pulled_tokens == 0
    assert logprob_gap(step.top_logprobs, probe.recomputed_logprobs(follow_up)) < LOGPROB_TOLERANCE


def test_a_holding_without_fingerprint_is_trusted_for_nothing(probe: KVProbe) -> None:
    history = tokens(5, 600)
    _, turn1 = probe.turn(history, max_tokens=NEW_TOKENS, retention_seconds=120)
    bare = {k: v for k, v in turn1.holding.items() if not k.startswith("agentkv_")}
    follow_up = history + turn1.token_ids + tokens(6, 40)

    step = probe.prefill(follow_up, bare)

    assert step.pulled_tokens == 0
    assert logprob_gap(step.top_logprobs, probe.recomputed_logprobs(follow_up)) < LOGPROB_TOLERANCE


def test_retention_zero_frees_the_blocks_at_once(probe: KVProbe) -> None:
    before = blocks_in_use(probe)
    _, kept = probe.turn(tokens(7, 700), max_tokens=16, retention_seconds=300)
    holding_some = blocks_in_use(probe)
    assert holding_some > before

    _, dropped = probe.turn(tokens(8, 700), max_tokens=16, retention_seconds=0)

    assert dropped.holding["agentkv_expires_in_seconds"] == 0
    assert blocks_in_use(probe) == holding_some
    release(probe, kept.holding["remote_request_id"])


def test_a_freed_holding_is_recomputed_not_read(probe: KVProbe) -> None:
    history = tokens(9, 600)
    _, turn1 = probe.turn(history, max_tokens=NEW_TOKENS, retention_seconds=0)
    follow_up = history + turn1.token_ids + tokens(10, 40)

    step = probe.prefill(follow_up, turn1.holding)

    assert step.pulled_tokens == 0
    assert logprob_gap(step.top_logprobs, probe.recomputed_logprobs(follow_up)) < LOGPROB_TOLERANCE


def test_release_frees_retained_blocks_at_once(probe: KVProbe) -> None:
    before = blocks_in_use(probe)
    held = [
        probe.turn(tokens(seed, 700), max_tokens=16, retention_seconds=300)[1] for seed in (11, 12)
    ]
    assert held[0].holding["agentkv_expires_in_seconds"] == 300
    assert blocks_in_use(probe) > before

    release(probe, *(step.holding["remote_request_id"] for step in held))

    assert wait_until(lambda: blocks_in_use(probe) == before)


def test_a_decode_step_frees_the_holdings_it_releases_and_keeps_its_own(probe: KVProbe) -> None:
    """How the router makes room for a step: the release goes with the step, not before it."""
    before = blocks_in_use(probe)
    _, old = probe.turn(tokens(13, 700), max_tokens=16, retention_seconds=300)
    holding_one = blocks_in_use(probe)
    prompt = tokens(14, 700)

    step = probe.decode(
        prompt,
        probe.prefill(prompt),
        retention_seconds=300,
        release=[old.holding["remote_request_id"]],
    )

    assert step.holding["agentkv_expires_in_seconds"] == 300
    assert wait_until(lambda: blocks_in_use(probe) == holding_one)  # one holding: the new one
    release(probe, step.holding["remote_request_id"])
    assert wait_until(lambda: blocks_in_use(probe) == before)


def test_forward_threads_keep_their_own_cores(stack: Stack) -> None:
    """The stall fix: upstream's NIXL worker re-pins the forward thread to the last core of
    its NUMA node, so every engine's forward pass would share one core."""
    for engine in stack.engines:
        assert engine.pid is not None and engine.spec.cores is not None
        [worker] = [pid for pid in _group(engine.pid) if _comm(pid) == "VLLM::Worker"]
        assert _allowed_cores(worker) == _cores(engine.spec.cores), engine.spec.name


def _group(pgid: int) -> list[int]:
    pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    return [pid for pid in pids if _process_group(pid) == pgid]


def _process_group(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Fields after "(comm)": state, ppid, pgrp, ...
            return int(stat.read().rsplit(")", 1)[1].split()[2])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as comm:
        return comm.read().strip()


def _allowed_cores(pid: int) -> set[int]:
    """The affinity of the process's main thread (the one that runs forward passes)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("Cpus_allowed_list:"))
    return _cores(line.split(":", 1)[1].strip())


def _cores(spec: str) -> set[int]:
    """Cores of a list like ``0,2-3``."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def test_streamed_turns_reuse_through_the_router(stack: Stack) -> None:
    """vLLM never streams kv_transfer_params; the router learns a streamed turn's holding only
    from D's report, and without it turn 2 could not reuse anything."""
    session = f"connector-stream-{time.time_ns()}"
    messages = [{"role": "user", "content": " ".join(f"item{i}" for i in range(700))}]
    headers = _chat(stack, session, messages)
    assert headers["x-agentkv-session-id"] == session

    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    headers = _chat(stack, session, messages)

    assert headers["x-agentkv-kv-path"] == "reuse"
    assert int(headers["x-agentkv-reused-tokens"]) > 0


def _chat(stack: Stack, session: str, messages: list[dict[str, str]]) -> dict[str, str]:
    """One streamed chat turn through the router; its response headers (lower-cased)."""
    body = {"model": stack.served_name, "messages": messages, "stream": True, "max_tokens": 8}
    request = urllib.request.Request(
        stack.endpoint + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": session},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        streamed = response.read().decode()
        headers = {name.lower(): value for name, value in response.headers.items()}
    assert "data: [DONE]" in streamed
    assert "kv_transfer_params" not in streamed
    return headers
