"""A real engine held to a known pace, for tests that fault a stream mid-answer.

Such a test must land its fault after the client has seen the stream's first token and before
the engine's last. A small test model makes a token in milliseconds, faster than that first
token crosses the API server, the router and the client on a loaded machine: CI saw an engine
finish all 160 tokens of a stream before its first reached the client, twice, once with the
engine's core slowed by signals from the test process. An engine loaded with
``paced(connector, step_s)`` is agentkv's own in every other respect, but each scheduler step
takes at least ``step_s``, so a stream of N tokens lasts at least N x ``step_s`` on any machine.

vLLM loads ``PacedConnector`` by name from this module; it is built on first use, so that the
launcher side (``paced``) imports no vLLM.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from agentkv_server.bundle.launcher import ConnectorSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["STEP_S", "paced"]

STEP_S = "agentkv_testing_step_s"
"""``kv_connector_extra_config`` key: the least seconds each scheduler step takes."""


def paced(connector: ConnectorSpec, step_s: float) -> ConnectorSpec:
    """``connector`` (agentkv's, with its settings) with each scheduler step taking at least
    ``step_s``."""
    return ConnectorSpec("PacedConnector", __name__, {**connector.extra_config, STEP_S: step_s})


def __getattr__(name: str) -> Any:
    if name == "PacedConnector":
        return _paced_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _paced_connector_class() -> type:
    from agentkv_server.connector.connector import AgentKVConnector

    class PacedConnector(AgentKVConnector):
        """AgentKVConnector whose scheduler half sleeps ``STEP_S`` seconds as it builds each
        step's metadata: once per engine step, in the engine core, before the forward pass."""

        def __init__(
            self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
        ) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            assert vllm_config.kv_transfer_config is not None
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            self._step_s = float(extra.get(STEP_S, 0.0))

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
            time.sleep(self._step_s)
            return super().build_connector_meta(scheduler_output)

    return PacedConnector
