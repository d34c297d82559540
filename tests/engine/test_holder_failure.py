"""A decode engine that dies while holding a session's KV: the next turn must still get a correct
answer, by recompute (the probe's bounded request timeout turns a hang into a failure). The doomed holder is an extra, short-lived decode engine
beside the shared stack (killing the stack's own would break every later test)."""

from __future__ import annotations

import random

import pytest

from agentkv_server.bundle.launcher import EngineProcess
from agentkv_server.bundle.probe import LOGPROB_TOLERANCE, EngineClient, KVProbe, logprob_gap

pytestmark = pytest.mark.engine


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def test_a_killed_holder_gives_a_correct_answer_by_recompute(
    probe: KVProbe, doomed: EngineProcess
) -> None:
    via_doomed = KVProbe(probe.p, EngineClient(doomed.url, probe.p.model, timeout=probe.p.timeout))
    history = tokens(40, 600)
    _, first = via_doomed.turn(history, max_tokens=48, retention_seconds=300)
    # A pull from the doomed engine first, so that P is connected to it when it dies.
    prompt = history + first.token_ids + tokens(41, 60)
    second_prefill, second = via_doomed.turn(prompt, first.holding, max_tokens=48)
    assert second_prefill.pulled_tokens > 0

    doomed.kill()
    follow_up = prompt + second.token_ids + tokens(42, 60)
    third = probe.prefill(follow_up, second.holding)
    assert third.pulled_tokens == 0
    assert logprob_gap(third.top_logprobs, probe.recomputed_logprobs(follow_up)) < LOGPROB_TOLERANCE
