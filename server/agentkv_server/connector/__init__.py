"""agentkv's vLLM KV connector: ``AgentKVConnector``, a NixlConnector subclass.

Engines load it by name (``kv_connector_module_path="agentkv_server.connector"``). The
facade imports vLLM, which takes seconds; it is imported on first use so the pure parts of
this package (wire fields, prefix fingerprints, reports, settings) load without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv_server.connector.prefix import PrefixFingerprint, common_prefix_tokens
from agentkv_server.connector.report import HoldingReporter
from agentkv_server.connector.settings import ConnectorSettings

if TYPE_CHECKING:
    from agentkv_server.connector.connector import AgentKVConnector

__all__ = [
    "AgentKVConnector",
    "ConnectorSettings",
    "HoldingReporter",
    "PrefixFingerprint",
    "common_prefix_tokens",
]


def __getattr__(name: str) -> Any:
    if name == "AgentKVConnector":
        from agentkv_server.connector.connector import AgentKVConnector

        return AgentKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
