"""The paced connector: agentkv's own, named so vLLM loads it, its steps held to a pace."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from agentkv_server.bundle.launcher import AGENTKV_CONNECTOR, ConnectorSpec
from agentkv_server.testing import paced_connector
from agentkv_server.testing.paced_connector import STEP_S, paced


def test_paced_keeps_the_connectors_settings_and_adds_the_pace() -> None:
    connector = ConnectorSpec("AgentKVConnector", "agentkv_server.connector", {"num_threads": 2})
    config = paced(connector, 0.2).transfer_config("decode-1")
    extra = config["kv_connector_extra_config"]
    assert (extra["num_threads"], extra[STEP_S]) == (2, 0.2)
    assert extra["bidirectional_kv_xfer"] is True


def test_vllm_finds_a_subclass_of_agentkvs_connector_by_module_path_and_name() -> None:
    from agentkv_server.connector.connector import AgentKVConnector

    config = paced(AGENTKV_CONNECTOR, 0.2).transfer_config(None)
    module = importlib.import_module(config["kv_connector_module_path"])
    assert issubclass(getattr(module, config["kv_connector"]), AgentKVConnector)


def test_each_step_waits_the_pace_then_builds_agentkvs_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentkv_server.testing.paced_connector import PacedConnector

    slept: list[float] = []
    monkeypatch.setattr(paced_connector.time, "sleep", slept.append)
    built = object()
    connector = PacedConnector.__new__(PacedConnector)
    connector._step_s = 0.2
    connector.connector_scheduler = SimpleNamespace(build_connector_meta=lambda _: built)
    assert connector.build_connector_meta(SimpleNamespace()) is built
    assert slept == [0.2]


def test_the_launcher_side_imports_no_vllm() -> None:
    code = (
        "import sys; from agentkv_server.testing.paced_connector import paced; "
        "assert 'vllm' not in sys.modules, 'vllm was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
