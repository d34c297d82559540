"""agentkv's local bundle: the models (real default, random-weight test models), engine processes, and whole stacks
(router + prefill + decode engines) as ``agentkv serve`` starts them."""

from agentkv_server.bundle.launcher import (
    AGENTKV_CONNECTOR,
    NIXL_CONNECTOR,
    ConnectorSpec,
    Device,
    EngineProcess,
    EngineSpec,
    Role,
)
from agentkv_server.bundle.model import (
    DEFAULT_MODEL,
    MODEL_NAMES,
    PRESETS,
    Dtype,
    ModelPreset,
    build_model,
    ensure_model,
    resolve_model,
)
from agentkv_server.bundle.ports import ensure_ports_free, free_ports, port_pool
from agentkv_server.bundle.process import ManagedProcess, log_tail
from agentkv_server.bundle.stack import Stack, StackConfig, core_layout

__all__ = [
    "AGENTKV_CONNECTOR",
    "DEFAULT_MODEL",
    "MODEL_NAMES",
    "NIXL_CONNECTOR",
    "PRESETS",
    "ConnectorSpec",
    "Device",
    "Dtype",
    "EngineProcess",
    "EngineSpec",
    "ManagedProcess",
    "ModelPreset",
    "Role",
    "Stack",
    "StackConfig",
    "build_model",
    "core_layout",
    "ensure_model",
    "ensure_ports_free",
    "free_ports",
    "log_tail",
    "port_pool",
    "resolve_model",
]
