"""One stack for the whole engine tier: the router, one prefill and one decode engine (AgentKV
connector, tiny fp32 test model), started once per test run, and a second such stack of the
real default model (SmolLM2-135M, fp32) for the tests that need real words: the examples, a
factual answer, and the oracle on real logits. Engines take ~30 s or more to start on a CPU, so
the tests share them; a test that must break an engine starts its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentkv_server.bundle.launcher import EngineProcess
from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.testing.paced_connector import paced
from agentkv_server.testing.probe import EngineClient, KVProbe

REQUEST_TIMEOUT_S = 120.0
# The router's cost model rightly recomputes a tiny model's short history when the engines are
# fast; the engine tier tests the KV path, so its routers always pull (the cost model is
# unit-tested with stub engines).
ALWAYS_PULL: dict[str, Any] = {"policy": "always"}
# A doomed decode engine's least seconds a step: a 160-token stream lasts 32 s or more, far
# longer than its first token takes to reach a client on a loaded machine (an unpaced one
# finished all 160 when that took 3.2 s).
DOOMED_STEP_S = 0.2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tiers first, then the engine tier, and within it the tests that kill engines
    last. The shared stack lives until the run ends and its engines keep stepping while they
    hold KV (docs/engines.md), so nothing may run after it but engine tests; a killed holder
    may leave a request parked on the prefill engine, so those tests come last of all. The
    multi-host tier (engine tests too) runs before the stack starts: its engines are gone by
    then, never more engines at once than the machine's memory holds."""
    items.sort(
        key=lambda item: (
            item.get_closest_marker("engine") is not None,
            item.get_closest_marker("multihost") is None,
            item.get_closest_marker("kills_engines") is not None,
        )
    )


def shared_stack(model: str | None, log_dir: Path) -> Stack:
    """A 1P1D stack in fp32 whose router always pulls (ALWAYS_PULL), for a whole test run."""
    config = StackConfig(
        model=model, dtype="float32", port=0, log_dir=log_dir, router_settings=ALWAYS_PULL
    )
    return Stack(config)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with shared_stack("tiny", tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="session")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default model (converted on first use), as ``agentkv serve`` serves it, in fp32."""
    with shared_stack(None, tmp_path_factory.mktemp("real-logs")) as running:
        yield running


@pytest.fixture(scope="session")
def probe(stack: Stack) -> KVProbe:
    """Plays the router's part by hand against the stack's P and D (token-id prompts)."""
    return probe_of(stack)


@pytest.fixture(params=["stack", "real_stack"])
def oracle_probe(request: pytest.FixtureRequest) -> KVProbe:
    """A probe of the tiny test model's stack, then of the real model's."""
    return probe_of(request.getfixturevalue(request.param))


def probe_of(stack: Stack) -> KVProbe:
    p, d = stack.prefill[0].url, stack.decode[0].url
    # A bounded wait: a request the KV path leaves hanging fails its test instead of the run.
    return KVProbe(
        EngineClient(p, stack.served_name, timeout=REQUEST_TIMEOUT_S),
        EngineClient(d, stack.served_name, timeout=REQUEST_TIMEOUT_S),
    )


@contextmanager
def extra_engines_like(
    models: dict[str, EngineProcess], log_dir: Path, step_s: float | None = None
) -> Iterator[dict[str, EngineProcess]]:
    """Engines like ``models`` (role, model, cores) on ports of their own, for tests to kill
    (killing one of the stack's own would break every later test); ``step_s``: each engine step
    takes at least that long (testing.paced_connector). They start together: an engine's start
    is mostly single-threaded imports, so two take about as long as one."""
    engines: dict[str, EngineProcess] = {}
    try:
        for name, model in models.items():
            port, side_channel_port = free_ports(2)
            connector = model.spec.connector
            spec = dataclasses.replace(
                model.spec,
                port=port,
                side_channel_port=side_channel_port,
                log_path=log_dir / f"{name}.log",
                connector=connector if step_s is None else paced(connector, step_s),
            )
            engines[name] = EngineProcess(spec)
            engines[name].start()
        for engine in engines.values():
            engine.wait_healthy(timeout=600)
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


@pytest.fixture(scope="module")
def extra_engines(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, EngineProcess]]:
    """A second decode engine beside the stack's, so that routers of a module can run 1P2D,
    and a spare prefill engine to kill; one start serves the whole module (a start costs
    30-90 s), so the last user of each may kill it."""
    models = {"second-decode": stack.decode[0], "spare-prefill": stack.prefill[0]}
    with extra_engines_like(models, tmp_path_factory.mktemp("extra-engines")) as engines:
        yield engines


@pytest.fixture
def doomed_decode(stack: Stack, tmp_path: Path) -> Iterator[EngineProcess]:
    """A decode engine of the test's own, to kill mid-stream: held to ``DOOMED_STEP_S`` a step,
    so that its streams last seconds on any machine."""
    models = {"doomed-decode": stack.decode[0]}
    with extra_engines_like(models, tmp_path, step_s=DOOMED_STEP_S) as engines:
        yield engines["doomed-decode"]


@pytest.fixture
def killable_prefill(stack: Stack, tmp_path: Path) -> Iterator[EngineProcess]:
    """A prefill engine of the test's own, to kill between its answer and D's read."""
    with extra_engines_like({"killable-prefill": stack.prefill[0]}, tmp_path) as engines:
        yield engines["killable-prefill"]


@pytest.fixture(scope="module")
def second_decode(extra_engines: dict[str, EngineProcess]) -> EngineProcess:
    return extra_engines["second-decode"]


@pytest.fixture(scope="module")
def doomed_prefill(extra_engines: dict[str, EngineProcess]) -> EngineProcess:
    return extra_engines["spare-prefill"]
