"""The connector package's public face, and the name vLLM loads it by."""

from __future__ import annotations

import subprocess
import sys

from agentkv_server import connector


def test_all_is_sorted_and_resolves() -> None:
    assert connector.__all__ == sorted(connector.__all__)
    for name in connector.__all__:
        assert getattr(connector, name) is not None


def test_vllm_finds_the_connector_by_module_path_and_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    assert issubclass(connector.AgentKVConnector, NixlConnector)


def test_pure_parts_import_without_vllm() -> None:
    code = (
        "import sys, agentkv_server.connector as c; c.PrefixFingerprint; "
        "assert 'vllm' not in sys.modules, 'vllm was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
