"""The capacity the overload preset's loads are multiples of, measured on stub engines whose
prefill takes 250 us a token (bench/capacity.py)."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv_server.bench.capacity import Capacity, measure_capacity
from agentkv_server.bench.modes import Deployment, serve_mode
from agentkv_server.bench.overload import OverloadWorkload
from agentkv_server.bench.runner import Runner
from agentkv_server.bench.workload import WordTokenizer, Workload
from agentkv_server.errors import AgentKVServerError
from agentkv_server.testing import StubCluster

TEXTS = Workload(sessions=1, turns=1, history_tokens=(400,), new_tokens=8, output_tokens=2)
WORKLOAD = OverloadWorkload(history_tokens=(300, 500), new_tokens=8, calibration_turns=3)


async def test_the_capacity_is_the_prefill_engines_rate_for_cold_turns(start_engines: Any) -> None:
    cluster = StubCluster(model="stub-model")
    prefill, decode = await start_engines(cluster)
    deployment = Deployment("stub-model", (prefill.url,), (decode.url,), (), 0, "secret")
    try:
        async with serve_mode("recompute", deployment) as target:
            runner = Runner(TEXTS, WordTokenizer())
            capacity = await measure_capacity(target, runner, WORKLOAD, "salt")
    finally:
        await cluster.close()
    assert len(capacity.prompt_tokens) == 3 and all(t > 400 for t in capacity.prompt_tokens)
    rate = 4000.0  # what the stub computes (conftest: 250 us a token), before any HTTP
    assert 0.3 * rate < capacity.tokens_per_s < rate
    firsts = {r.body["messages"][0]["content"].splitlines()[0] for r in prefill.completions()}
    assert len(firsts) == 3  # each salted: nothing cached from another
    assert Capacity.from_dict(capacity.to_dict()) == capacity


def test_no_capacity_is_no_capacity() -> None:
    with pytest.raises(AgentKVServerError):
        Capacity(0.0, "given")
