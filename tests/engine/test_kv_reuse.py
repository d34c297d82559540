"""KV reuse across turns on real engines, judged by the oracle of docs/engines.md.

The oracle, on the fp32 tiny test model and on the fp32 real model: the first token's top-5 logprobs after a pull must equal
(1) D's answer to the same prompt from its own prefix cache, which uses the very KV the pull
copies, and (2) a full recompute, within LOGPROB_TOLERANCE. The negative control proves that the
oracle catches wrong KV: fooled into loading another conversation's KV, P answers differently.

Turns are sized so that D holds whole blocks (128 tokens on the CPU backend): then D's prefix
cache covers exactly the held tokens and (1) holds bit for bit.
"""

from __future__ import annotations

import random
import time

import pytest

from agentkv_server.connector import PrefixFingerprint
from agentkv_server.testing.probe import LOGPROB_TOLERANCE, KVProbe, logprob_gap

pytestmark = pytest.mark.engine

BLOCK = 128  # vLLM's KV block on the CPU backend
OUTPUT = 41  # D holds prompt + OUTPUT - 1 tokens
HISTORY = 5 * BLOCK - OUTPUT + 1  # turn 1 holds 5 whole blocks
NEW = BLOCK - OUTPUT  # and each later turn one block more


def tokens(seed: int, n: int) -> list[int]:
    """Token ids no other test module produces: P's and D's prefix caches are shared by the
    whole run, and a prefix another test left there would be a local hit instead of a pull."""
    rng = random.Random(f"{__name__}:{seed}")
    return [rng.randrange(10, 4000) for _ in range(n)]


def fresh() -> dict[str, str]:
    return {"cache_salt": f"fresh-{time.time_ns()}"}


def test_each_turn_pulls_what_the_decode_engine_holds_and_matches_recompute(
    oracle_probe: KVProbe,
) -> None:
    probe = oracle_probe
    prompt = tokens(1, HISTORY)
    holding = None
    for turn in range(1, 4):
        if holding is not None:
            reference = probe.decode_engine_logprobs(prompt)
            assert reference.local_hit_tokens == holding["remote_num_tokens"]
        prefill, decode = probe.turn(prompt, holding, max_tokens=OUTPUT, retention_seconds=120)
        if holding is None:
            assert prefill.pulled_tokens == 0
        else:
            # P loads every held token: from its own prefix cache what it computed itself
            # (turn 1's prompt), the rest from D.
            assert prefill.pulled_tokens > 0, f"turn {turn} pulled nothing"
            assert prefill.pulled_tokens + prefill.local_hit_tokens == holding["remote_num_tokens"]
            assert logprob_gap(prefill.top_logprobs, reference.top_logprobs) < 1e-6
            recomputed = probe.recomputed_logprobs(prompt)
            assert logprob_gap(prefill.top_logprobs, recomputed) < LOGPROB_TOLERANCE
        assert decode.holding["remote_num_tokens"] == len(prompt) + OUTPUT - 1
        assert decode.holding["remote_num_tokens"] % BLOCK == 0
        holding = decode.holding
        prompt = prompt + decode.token_ids + tokens(100 + turn, NEW)


def test_a_follow_ups_new_blocks_read_synchronously_match_recompute(
    oracle_probe: KVProbe,
) -> None:
    """D reads the new part P computed before the step that computes the request's first token
    (docs/connector.md, "Synchronous loads"); that token must be the recompute's. Turn 1's own
    read proves the pair, so turn 2's is synchronous. Its new part fills two blocks and starts
    a third: vLLM caches a synchronous load's whole blocks as it allocates them, and every one
    of them must still be read."""
    probe = oracle_probe
    prompt = tokens(7, HISTORY)
    _, first = probe.turn(prompt, max_tokens=OUTPUT, retention_seconds=120)
    assert first.holding["agentkv_kv_load"] == "ok"
    prompt = prompt + first.token_ids + tokens(107, 2 * BLOCK + NEW)
    prefill = probe.prefill(prompt, first.holding)

    answer = probe.decode_first_token(prompt, prefill)

    assert (answer.params["agentkv_kv_load"], answer.params.get("agentkv_kv_load_sync")) == (
        "ok",
        True,
    )
    assert logprob_gap(answer.top_logprobs, probe.recomputed_logprobs(prompt)) < LOGPROB_TOLERANCE


def test_the_oracle_catches_wrong_kv(oracle_probe: KVProbe) -> None:
    """Negative control. Two conversations of equal length; P is given B's blocks under a
    fingerprint of A's tokens, so prefix verification lets the wrong KV through."""
    probe = oracle_probe
    a, b = tokens(2, HISTORY), tokens(3, HISTORY)
    _, held_a = probe.turn(a, max_tokens=OUTPUT, retention_seconds=120)
    _, held_b = probe.turn(b, max_tokens=OUTPUT, retention_seconds=120)
    follow_up = a + held_a.token_ids + tokens(4, NEW)
    recomputed = probe.recomputed_logprobs(follow_up)
    held_tokens = follow_up[: held_a.holding["remote_num_tokens"]]
    fingerprint = PrefixFingerprint.of(held_tokens, held_a.holding["agentkv_hash_block_size"])

    # A fresh cache salt per request: no local prefix-cache hits, every held token is pulled
    # (and the wrong KV that the forged pull leaves in P's cache stays out of later requests).
    forged = probe.prefill(follow_up, {**held_b.holding, **fingerprint.to_params()}, **fresh())
    assert forged.pulled_tokens == len(held_tokens)
    assert logprob_gap(forged.top_logprobs, recomputed) > 100 * LOGPROB_TOLERANCE

    genuine = probe.prefill(follow_up, held_a.holding, **fresh())
    assert genuine.pulled_tokens == len(held_tokens)
    assert logprob_gap(genuine.top_logprobs, recomputed) < LOGPROB_TOLERANCE


def test_an_expired_holding_is_recomputed(probe: KVProbe) -> None:
    history = tokens(5, HISTORY)
    _, decode = probe.turn(history, max_tokens=OUTPUT, retention_seconds=1)
    time.sleep(3)
    follow_up = history + decode.token_ids + tokens(6, NEW)
    prefill = probe.prefill(follow_up, decode.holding)
    assert prefill.pulled_tokens == 0
    assert (
        logprob_gap(prefill.top_logprobs, probe.recomputed_logprobs(follow_up)) < LOGPROB_TOLERANCE
    )
