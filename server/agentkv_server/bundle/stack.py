"""A whole local deployment: N prefill and M decode engines plus the router in front of them.

``Stack`` is what ``agentkv serve``, the engine-tier tests and the measurement script start.
Engines start together (each takes ~30 s on a CPU, longer when they share cores), the router
after them so that its first health check already finds them serving. Stopping goes the other
way round, and every process is stopped with its whole process group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typing_extensions import Self

from agentkv_server.bundle.launcher import (
    AGENTKV_CONNECTOR,
    ConnectorSpec,
    Device,
    EngineProcess,
    EngineSpec,
    Role,
)
from agentkv_server.bundle.model import (
    GIB,
    Dtype,
    is_test_model,
    min_kv_cache_gib,
    preset_of,
    resolve_model,
    tool_call_logit_bias,
)
from agentkv_server.bundle.ports import ensure_ports_free, free_ports, port_pool
from agentkv_server.bundle.process import ManagedProcess
from agentkv_server.errors import ConfigError, PortInUseError
from agentkv_server.settings import AdmissionSettings, LocalPathSettings
from agentkv_server.wire import (
    API_KEYS_ENV,
    CLIENT_BASE_URL_ENV,
    CLIENT_LOGIT_BIAS_ENV,
    CLIENT_MODEL_ENV,
    ROUTER_URL_ENV,
    SECRET_ENV,
)

__all__ = ["Stack", "StackConfig", "core_layout"]

logger = logging.getLogger(__name__)

# Starts per engine when its ports turn out to be taken (another program bound one between
# our check and the engine's bind): each retry takes other ports.
PORT_ATTEMPTS = 3


@dataclass(frozen=True)
class StackConfig:
    """What to start. ``port`` is the router's (0: any free port); engines take free ports
    from ``port_base`` on (None: ``$AGENTKV_PORT_BASE`` or 20000; never the ephemeral range).
    ``prefill_args`` and ``decode_args`` go to engines of that role only, after ``engine_args``;
    decode engines also get :attr:`slice_args` (from ``router_settings``), first. Without a router of its
    own (``router=False``), ``report_port`` is where one will listen on ``host``: decode engines
    report their holdings there (``agentkv bench`` starts a router per mode)."""

    model: str | None = None  # a model name or directory; None: the default (smollm2)
    dtype: Dtype = "float32"
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    log_dir: Path = Path(".agentkv/logs")
    device: Device = "cpu"
    connector: ConnectorSpec = AGENTKV_CONNECTOR
    engine_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router: bool = True
    report_port: int | None = None
    router_settings: Mapping[str, Any] = field(default_factory=dict)  # Settings fields, as JSON
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # clients' keys, for the router
    cpu_cores: tuple[int, ...] | None = None  # None: the cores this process may run on
    # Each engine's KV cache on a CPU (VLLM_CPU_KVCACHE_SPACE), raised to what the model needs
    # for one full-length sequence (engine_kv_cache_gib).
    kv_cache_gib: int = 1
    # Host memory below each decode engine's KV cache for the KV of holdings released for room
    # (launcher.with_host_tier); 0: none.
    host_tier_gib: float = 0.0
    port_base: int | None = None
    router_log_level: str = "warning"  # the router's --log-level

    def __post_init__(self) -> None:
        if self.decode < 1 or self.prefill < 0:
            raise ConfigError("a stack needs at least one decode engine and no negative counts")
        port_pool(self.port_base)  # a base inside the ephemeral range fails here, not later

    @property
    def slice_args(self) -> tuple[str, ...]:
        """The options decode engines need for the router to price its local path right: the
        prefill slice of its settings (LocalPathSettings.slice_tokens)."""
        local = self.router_settings.get("local", {})
        return LocalPathSettings.model_validate(local).decode_engine_args()

    @property
    def prefill_step_args(self) -> tuple[str, ...]:
        """The options prefill engines need for the router's queue to mean what it predicts:
        its step size (AdmissionSettings.prefill_step_tokens)."""
        admission = self.router_settings.get("admission", {})
        return AdmissionSettings.model_validate(admission).prefill_engine_args()

    @property
    def available_cores(self) -> tuple[int, ...]:
        return self.cpu_cores or tuple(sorted(os.sched_getaffinity(0)))

    @property
    def engine_kv_cache_gib(self) -> int:
        """The KV cache each engine gets on a CPU: ``kv_cache_gib``, or more where the model
        needs more for one sequence of its full context (``tiny-long``: 2 GiB in fp32), since
        vLLM refuses to start an engine whose KV cache cannot hold one."""
        return max(self.kv_cache_gib, min_kv_cache_gib(self.model, self.dtype))

    def kv_cache_note(self) -> str | None:
        """Why each engine gets more KV cache than ``kv_cache_gib``, when it does."""
        given = self.engine_kv_cache_gib
        found = preset_of(self.model, self.dtype)
        if self.device != "cpu" or given <= self.kv_cache_gib or found is None:
            return None
        preset, dtype = found
        sequence_gib = preset.kv_bytes_per_token(dtype) * preset.max_position_embeddings / GIB
        return (
            f"each engine gets {given} GiB of KV cache (VLLM_CPU_KVCACHE_SPACE), not "
            f"{self.kv_cache_gib}: one {preset.max_position_embeddings}-token sequence of "
            f"{preset.name} ({dtype}) takes {sequence_gib:.2f} GiB of KV, and vLLM refuses to "
            "start an engine that cannot hold one"
        )

    def shared_cores_note(self) -> str | None:
        """Why engines on a CPU will share cores, when they must (more engines than cores)."""
        engines, cores = self.prefill + self.decode, len(self.available_cores)
        if self.device != "cpu" or engines <= cores:
            return None
        return (
            f"{engines} engines share {cores} CPU cores: engines on one core take turns, a "
            "request on one may wait for the other's streams to end; prefill and decode engines "
            'never share one (idle engines use almost no CPU; docs/engines.md, "Cores")'
        )


class Stack:
    """Start with ``start()`` (or ``with Stack(config) as stack:``), stop with ``stop()``."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.engines: list[EngineProcess] = []
        self.router: ManagedProcess | None = None
        self.served_name = ""
        self.model_dir: Path | None = None
        self._router_port = config.port

    @property
    def prefill(self) -> list[EngineProcess]:
        return [engine for engine in self.engines if engine.spec.role == "prefill"]

    @property
    def decode(self) -> list[EngineProcess]:
        return [engine for engine in self.engines if engine.spec.role == "decode"]

    @property
    def endpoint(self) -> str:
        """Where clients send requests: the router, or the first decode engine without one."""
        if self.config.router:
            return f"http://{self.config.host}:{self._router_port}"
        return self.decode[0].url

    def client_environment(self) -> dict[str, str]:
        """The environment an agent program needs to use this stack (the examples read it)."""
        env = {CLIENT_BASE_URL_ENV: f"{self.endpoint}/v1", CLIENT_MODEL_ENV: self.served_name}
        if self.model_dir is not None and is_test_model(self.model_dir):
            env[CLIENT_LOGIT_BIAS_ENV] = json.dumps(tool_call_logit_bias(self.model_dir))
        return env

    @property
    def log_paths(self) -> dict[str, Path]:
        return {process.name: process.log_path for process in self._processes()}

    def start(self, timeout: float = 600.0) -> Stack:
        """Start everything and wait until it is healthy; on any failure stop what started
        and raise EngineError carrying the failing process's log tail."""
        config = self.config
        self.engines = [EngineProcess(spec) for spec in self.plan()]
        try:
            for engine in self.engines:
                _start_unless_ports_taken(engine)
            for i, engine in enumerate(self.engines):
                self.engines[i] = self._healthy_engine(engine, timeout)
            if config.router:
                self.router = self._router_process()
                self.router.start()
                self.router.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy_engine(self, engine: EngineProcess, timeout: float) -> EngineProcess:
        """Wait for ``engine``; on a port clash start it again on other ports, a few times."""
        attempt = 1
        while True:
            try:
                if engine.pid is None:  # its first start found a port taken
                    engine.start()
                engine.wait_healthy(timeout)
                return engine
            except PortInUseError as clash:
                engine.stop()
                if attempt == PORT_ATTEMPTS:
                    raise
                attempt += 1
                logger.warning("%s; starting it again on other ports", str(clash).splitlines()[0])
                port, side_channel_port = self._free_ports(2)
                engine = EngineProcess(
                    dataclasses.replace(engine.spec, port=port, side_channel_port=side_channel_port)
                )

    def exited(self) -> list[ManagedProcess]:
        """Processes of a started stack that are no longer running."""
        return [process for process in self._processes() if not process.is_running()]

    def _processes(self) -> list[ManagedProcess]:
        return [*self.engines, *([self.router] if self.router else [])]

    def stop(self) -> None:
        """Stop the router, then every engine (each with its whole process group)."""
        if self.router is not None:
            self.router.stop()
        for engine in reversed(self.engines):
            engine.stop()

    def plan(self) -> list[EngineSpec]:
        """The engines to start: the model (built if needed), roles, free ports, cores, and the
        router's address and secret for the decode engines' holding reports."""
        config = self.config
        model_dir, self.served_name = resolve_model(config.model, dtype=config.dtype)
        self.model_dir = model_dir
        if config.router:
            self._router_port = config.port or self._free_ports(1)[0]
            ensure_ports_free(config.host, [self._router_port])
        roles: list[Role] = ["prefill"] * config.prefill + ["decode"] * config.decode
        ports = self._free_ports(2 * len(roles))
        cores = (
            core_layout(roles, config.available_cores)
            if config.device == "cpu"
            else [None] * len(roles)
        )
        report_port = self._router_port if config.router else config.report_port
        report_to = {
            ROUTER_URL_ENV: f"http://{config.host}:{report_port}",
            SECRET_ENV: config.secret,
        }
        return [
            EngineSpec(
                role=role,
                model=model_dir,
                served_name=self.served_name,
                port=ports[2 * i],
                side_channel_port=ports[2 * i + 1],
                log_path=config.log_dir / f"{role}-{i}.log",
                connector=config.connector,
                host=config.host,
                device=config.device,
                cores=cores[i],
                kv_cache_gib=config.engine_kv_cache_gib,
                host_tier_gib=config.host_tier_gib if role == "decode" else 0.0,
                engine_args=(
                    (*config.prefill_step_args, *config.engine_args, *config.prefill_args)
                    if role == "prefill"
                    else (*config.slice_args, *config.engine_args, *config.decode_args)
                ),
                env=report_to if report_port else {},
            )
            for i, role in enumerate(roles)
        ]

    def _free_ports(self, count: int) -> list[int]:
        return free_ports(count, self.config.host, pool=port_pool(self.config.port_base))

    def router_command(self, settings_file: Path) -> list[str]:
        """The router's command line, in front of the started engines."""
        config = self.config
        return [
            sys.executable, "-m", "agentkv_server.cli", "router",
            "--config", str(settings_file),
            "--host", config.host,
            "--port", str(self._router_port),
            "--log-level", config.router_log_level,
            "--prefill-url", *(engine.url for engine in self.prefill),
            "--decode-url", *(engine.url for engine in self.decode),
        ]  # fmt: skip

    def _router_process(self) -> ManagedProcess:
        config = self.config
        settings_file = config.log_dir / "router-settings.json"
        settings_file.write_text(json.dumps(dict(config.router_settings), indent=2))
        url = f"http://{config.host}:{self._router_port}"
        return ManagedProcess(
            "router",
            self.router_command(settings_file),
            health_url=url + "/health",
            log_path=config.log_dir / "router.log",
            # Secrets travel in the environment: ps shows command lines, and a settings file
            # written from the model holds masked values.
            env={**os.environ, SECRET_ENV: config.secret, **_api_keys_env(config.api_keys)},
            dies_with_launcher=True,
        )

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _start_unless_ports_taken(engine: EngineProcess) -> None:
    """Start ``engine``; a port taken before it starts is left to ``_healthy_engine``."""
    try:
        engine.start()
    except PortInUseError as clash:
        logger.warning("%s", clash)


def _api_keys_env(keys: Sequence[str]) -> dict[str, str]:
    return {API_KEYS_ENV: ",".join(keys)} if keys else {}


def core_layout(roles: Sequence[Role], cores: Sequence[int]) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per engine, in the order of ``roles``.

    With a core or more per engine: disjoint contiguous runs of ``cores``. With fewer, engines
    share cores, but never a prefill engine with a decode engine: the two roles get disjoint
    sets (prefill first, in proportion to its engines, at least one core each) and engines of
    one role take their set's cores round-robin. A KV read completes only while the engine that
    holds the blocks makes NIXL progress, and a reader waiting on its holder busy-polls: on the
    holder's core it starved the holder and stalled every read between the two for seconds
    (docs/faults.md, "Pulls that stall"). Engines of one role never read from each other.
    """
    if not cores:
        raise ConfigError("no CPU cores to place engines on")
    prefill = sum(role == "prefill" for role in roles)
    decode = len(roles) - prefill
    if len(roles) <= len(cores) or not prefill or not decode or len(cores) < 2:
        return _spread(len(roles), cores)
    split = min(max(round(len(cores) * prefill / len(roles)), 1), len(cores) - 1)
    by_role = {
        "prefill": iter(_spread(prefill, cores[:split])),
        "decode": iter(_spread(decode, cores[split:])),
    }
    return [next(by_role[role]) for role in roles]


def _spread(engines: int, cores: Sequence[int]) -> list[str]:
    """Each engine its own contiguous run of ``cores`` if there are enough, else one core each
    in turn."""
    if engines <= len(cores):
        size = len(cores) // engines
        return [_span(cores[i * size : (i + 1) * size]) for i in range(engines)]
    return [str(cores[i % len(cores)]) for i in range(engines)]


def _span(cores: Sequence[int]) -> str:
    first, last = cores[0], cores[-1]
    if list(cores) == list(range(first, last + 1)):
        return str(first) if first == last else f"{first}-{last}"
    return ",".join(map(str, cores))
