"""An idle stack idles: once the turns stop, each engine's whole process tree (API server,
EngineCore, worker) uses a few percent of one core, not a core (docs/connector.md, "Idle
engines"). The decode engine still holds the session's KV, the case that kept it stepping.

``pytest -s`` prints each engine's share and its busiest threads."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from agentkv import protocol
from agentkv_server.bundle.stack import Stack
from agentkv_server.testing.cpu_usage import sample_group_cpu

pytestmark = pytest.mark.engine

IDLE_S = 40.0  # the connector's idle waits reach their longest within ~30 s
WINDOW_S = 15.0
MAX_SHARE = 0.05  # of one core, per engine process tree
TURNS = 3


def test_idle_engines_use_a_few_percent_of_a_core(stack: Stack) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(10, 4000) for _ in range(600)]
    session = f"idle-cpu-{time.time_ns()}"
    paths = []
    with httpx.Client(base_url=stack.endpoint, timeout=120.0) as client:
        for _ in range(TURNS):
            response = client.post(
                "/v1/completions",
                json={
                    "model": stack.served_name,
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
                headers={protocol.HEADER_SESSION_ID: session},
            )
            response.raise_for_status()
            paths.append(response.headers.get(protocol.HEADER_KV_PATH))
            prompt += response.json()["choices"][0]["token_ids"] + [rng.randrange(10, 4000)]
    time.sleep(IDLE_S)
    usage = sample_group_cpu({e.name: e.pid for e in stack.engines if e.pid}, WINDOW_S)

    print(f"\nturn paths {paths}; {IDLE_S:.0f} s idle, then {WINDOW_S:.0f} s sampled:")
    for name, cpu in usage.items():
        print(f"  {name}: {100 * cpu.cores:.1f} % of a core; busiest: {cpu.busiest(3)}")
    assert "reuse" in paths  # the decode engine holds KV through the idle time
    assert len(usage) == len(stack.engines)
    for name, cpu in usage.items():
        assert cpu.cores < MAX_SHARE, f"{name} idles at {100 * cpu.cores:.1f} % of a core"
