"""Several hosts on one machine: Redis, two router replicas, a prefill and two decode engines and
the agent, each in its own network namespace with its own address on one bridge (10.77.0.0/24).

Every process is started inside its host with ``ip netns exec``; the test process itself sits on
the bridge (10.77.0.254), as an operator's machine would, to poll health and engine metrics.
The engines move KV over UCX's TCP transport between their hosts. The cluster lives for the
module and is torn down (processes, then namespaces and links) even when a test fails; the
finalizer asserts that nothing of it is left.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import select
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import Self

from agentkv_server.bench.engines import PREFILL_ARGS
from agentkv_server.bundle.launcher import ENGINE_FATAL_MARKERS, EngineSpec, Role
from agentkv_server.bundle.model import resolve_model
from agentkv_server.bundle.process import ManagedProcess
from agentkv_server.bundle.stack import core_layout
from agentkv_server.testing import RedisServer
from agentkv_server.testing.conditions import require
from agentkv_server.testing.netns import Host, Network, netns_available, our_leftovers
from agentkv_server.testing.probe import EngineClient
from agentkv_server.wire import ROUTER_URL_ENV, SECRET_ENV

SUBNET = "10.77.0.0/24"
ENGINE_PORT = 8100
SIDE_CHANNEL_PORT = 5600
ROUTER_PORT = 8000
REDIS_PORT = 6379
START_TIMEOUT_S = 600.0
TURN_TIMEOUT_S = 180.0
CLIENT_SCRIPT = Path(__file__).with_name("client_turns.py")
ENGINES: tuple[tuple[str, Role], ...] = (
    ("prefill", "prefill"),
    ("decode-a", "decode"),
    ("decode-b", "decode"),
)


@dataclass
class Cluster:
    network: Network
    routers: list[str]  # the replicas' URLs
    prefill: EngineClient
    decode: dict[str, EngineClient]  # by host name
    served_name: str

    def host(self, name: str) -> Host:
        return self.network.hosts[name]

    def agent(self, session_id: str) -> Agent:
        """The agent, started on the client host, for one session."""
        command = self.host("client").command(
            sys.executable, str(CLIENT_SCRIPT), session_id, self.served_name
        )
        return Agent(command)


class Agent:
    """client_turns.py on the client host; ``turn`` sends one call and returns its report."""

    def __init__(self, command: list[str]) -> None:
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def turn(self, router: str, prompt: list[int]) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps({"router": router, "prompt": prompt}) + "\n")
        self._process.stdin.flush()
        ready, _, _ = select.select([self._process.stdout], [], [], TURN_TIMEOUT_S)
        line = self._process.stdout.readline() if ready else ""
        if not line:
            self.close()
            stderr = self._process.stderr.read() if self._process.stderr else ""
            raise AssertionError(f"the agent got no answer from {router}:\n{stderr[-3000:]}")
        return dict(json.loads(line))

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def engine_process(spec: EngineSpec, host: Host) -> ManagedProcess:
    return ManagedProcess(
        f"{host.name} engine",
        host.command(*spec.command()),
        health_url=spec.url + "/health",
        log_path=spec.log_path,
        env=spec.environment(),
        fatal_markers=ENGINE_FATAL_MARKERS,
    )


def router_process(host: Host, redis_url: str, engines: dict[str, EngineSpec], logs: Path,
                   secret: str) -> ManagedProcess:  # fmt: skip
    url = f"http://{host.address}:{ROUTER_PORT}"
    command = host.command(
        sys.executable, "-m", "agentkv_server.cli", "router",
        "--host", host.address,
        "--port", str(ROUTER_PORT),
        "--redis", redis_url,
        # The tier tests the KV path between hosts; the tiny model's short history would
        # rightly be recomputed by the cost model (unit-tested with stub engines).
        "--policy", "always",
        "--health-interval", "1",
        "--prefill", *(spec.url for spec in engines.values() if spec.role == "prefill"),
        "--decode", *(spec.url for spec in engines.values() if spec.role == "decode"),
        "--log-level", "info",
    )  # fmt: skip
    return ManagedProcess(
        f"router on {host.name}",
        command,
        health_url=url + "/health",
        log_path=logs / f"{host.name}.log",
        env={**os.environ, SECRET_ENV: secret},
    )


def engine_specs(network: Network, logs: Path, model: Path, served_name: str, secret: str,
                 report_to: str) -> dict[str, EngineSpec]:  # fmt: skip
    cores = core_layout([role for _, role in ENGINES], tuple(sorted(os.sched_getaffinity(0))))
    env = {
        ROUTER_URL_ENV: report_to,
        SECRET_ENV: secret,
        # Namespaces share one kernel: UCX would find the peer's shared memory and the KV
        # would never cross the link. Real hosts have no shared memory to find.
        "UCX_TLS": "self,tcp",
    }
    return {
        name: EngineSpec(
            role=role,
            model=model,
            served_name=served_name,
            port=ENGINE_PORT,
            side_channel_port=SIDE_CHANNEL_PORT,
            log_path=logs / f"{name}.log",
            host=network.hosts[name].address,
            cores=cores[i],
            env=env,
            # P's own prefix cache would hold a session's history after its recomputed turn,
            # and the router counts P's cached tokens as reused: a pull that failed on a cut
            # link then read as "reuse" (seen once). Without it, what P reports cached is
            # what it pulled over the link, as in `agentkv bench`.
            engine_args=PREFILL_ARGS if role == "prefill" else (),
        )
        for i, (name, role) in enumerate(ENGINES)
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require(netns_available())
    require(None if RedisServer.available() else "redis-server not found (scripts/install --dev)")
    logs = tmp_path_factory.mktemp("multihost")
    model, served_name = resolve_model("tiny", dtype="float32")
    secret = secrets.token_urlsafe(24)
    network = Network(SUBNET)
    atexit.register(network.stop)  # a run ended by an error outside pytest's teardown
    processes: list[ManagedProcess] = []
    redis: RedisServer | None = None
    try:
        network.start()
        for name in ("redis", "router-a", "router-b", *(name for name, _ in ENGINES), "client"):
            network.add(name)
        router_hosts = [network.hosts["router-a"], network.hosts["router-b"]]
        routers = [f"http://{host.address}:{ROUTER_PORT}" for host in router_hosts]
        redis_host = network.hosts["redis"]
        redis = RedisServer(host=redis_host.address, port=REDIS_PORT, wrapper=redis_host.command())
        redis.start()
        specs = engine_specs(network, logs, model, served_name, secret, report_to=routers[0])
        engines = [engine_process(spec, network.hosts[name]) for name, spec in specs.items()]
        processes += engines
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(START_TIMEOUT_S)
        routers_started = [router_process(h, redis.url, specs, logs, secret) for h in router_hosts]
        processes += routers_started
        for router in routers_started:
            router.start()
        for router in routers_started:
            router.wait_healthy(START_TIMEOUT_S)
        yield Cluster(
            network=network,
            routers=routers,
            prefill=EngineClient(specs["prefill"].url, served_name),
            decode={
                name: EngineClient(spec.url, served_name)
                for name, spec in specs.items()
                if spec.role == "decode"
            },
            served_name=served_name,
        )
    finally:
        for process in reversed(processes):
            process.stop()
        if redis is not None:
            redis.stop()
        network.stop()
        atexit.unregister(network.stop)
        left = our_leftovers(network.tag + "-")
        assert left == ([], []), f"namespaces and links left behind: {left}"
