"""Engine command lines and environments: what each engine needs to join the KV path."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agentkv_server.bundle.launcher import (
    AGENTKV_CONNECTOR,
    NIXL_CONNECTOR,
    ConnectorSpec,
    EngineSpec,
    parse_cores,
    pin_engine_core,
    pin_unplaced_threads,
)


def spec(**changes: object) -> EngineSpec:
    base = {
        "role": "decode",
        "model": Path("/models/tiny"),
        "served_name": "agentkv-tiny",
        "port": 8200,
        "side_channel_port": 5600,
        "log_path": Path("/logs/decode.log"),
        "cores": "1",
    }
    return EngineSpec(**{**base, **changes})  # type: ignore[arg-type]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_command_runs_the_api_server_module_with_the_agentkv_connector() -> None:
    command = spec().command()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--model") == "/models/tiny"
    assert flag(command, "--served-model-name") == "agentkv-tiny"
    assert (flag(command, "--host"), flag(command, "--port")) == ("127.0.0.1", "8200")
    transfer = json.loads(flag(command, "--kv-transfer-config"))
    assert transfer == {
        "kv_connector": "AgentKVConnector",
        "kv_connector_module_path": "agentkv_server.connector",
        "kv_role": "kv_both",
        "engine_id": "decode-8200",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "num_threads": 0},
    }
    assert flag(command, "--tool-call-parser") == "hermes"
    assert "--enforce-eager" in command


def test_a_host_tier_puts_vllms_offloading_connector_beside_agentkvs() -> None:
    transfer = json.loads(flag(spec(host_tier_gib=0.5).command(), "--kv-transfer-config"))
    assert (transfer["kv_connector"], transfer["engine_id"]) == ("MultiConnector", "decode-8200")
    first, offload = transfer["kv_connector_extra_config"]["connectors"]
    # AgentKV's first, so that a P/D step's prompt is its to load; vLLM gives it the engine id.
    assert first["kv_connector"] == "AgentKVConnector" and "engine_id" not in first
    assert first["kv_connector_extra_config"]["agentkv_host_tier_bytes"] == 1 << 29
    assert offload["kv_connector"] == "OffloadingConnector"
    assert offload["kv_connector_extra_config"] == {
        "spec_name": "HostTierSpec",
        "spec_module_path": "agentkv_server.connector.hosttier",
        "cpu_bytes_to_use": 1 << 29,
        "offload_prompt_only": False,
    }
    # On a GPU, vLLM's own spec (the default) copies between device and host.
    gpu = json.loads(flag(spec(host_tier_gib=0.5, device="cuda").command(), "--kv-transfer-config"))
    tier = gpu["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert "spec_name" not in tier and tier["cpu_bytes_to_use"] == 1 << 29


def test_the_vllm_plugin_names_the_connector_for_multiconnector() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from agentkv_server.connector import AgentKVConnector

    (plugin,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == "agentkv_connector"
    ]
    register = plugin.load()
    register()
    register()  # every vLLM process may load plugins more than once
    assert KVConnectorFactory.get_connector_class_by_name("AgentKVConnector") is AgentKVConnector


def test_upstream_connector_needs_no_module_path() -> None:
    transfer = json.loads(flag(spec(connector=NIXL_CONNECTOR).command(), "--kv-transfer-config"))
    assert transfer["kv_connector"] == "NixlConnector"
    assert "kv_connector_module_path" not in transfer


def test_pass_through_arguments_come_last_so_they_win() -> None:
    command = spec(engine_args=("--max-model-len", "4096")).command()
    assert command[-2:] == ["--max-model-len", "4096"]


def test_cpu_environment_separates_engines() -> None:
    env = spec().environment(base={"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("self,sm,tcp", "lo")
    assert env["HF_HUB_OFFLINE"] == "1"


def test_an_engine_on_a_network_address_leaves_ucx_its_interfaces() -> None:
    """Pinned to lo, UCX could never reach a peer on another host (tests/multihost)."""
    env = spec(host="10.77.0.4").environment(base={})
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.77.0.4"
    assert "UCX_NET_DEVICES" not in env
    assert env["UCX_TLS"] == "self,sm,tcp"


def test_gpu_engines_get_no_cpu_settings_and_no_eager_mode() -> None:
    gpu = spec(device="cuda", cores=None)
    env = gpu.environment(base={})
    assert not {"UCX_TLS", "UCX_NET_DEVICES", "VLLM_CPU_OMP_THREADS_BIND"} & env.keys()
    assert "--enforce-eager" not in gpu.command()
    transfer = json.loads(flag(gpu.command(), "--kv-transfer-config"))
    assert transfer["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True}


def test_connector_extra_config_overrides_the_cpu_defaults() -> None:
    connector = ConnectorSpec("AgentKVConnector", "agentkv_server.connector", {"num_threads": 2})
    transfer = json.loads(flag(spec(connector=connector).command(), "--kv-transfer-config"))
    assert transfer["kv_connector_extra_config"]["num_threads"] == 2


def test_extra_environment_wins() -> None:
    env = spec(env={"UCX_TLS": "tcp", "AGENTKV_SECRET": "s"}).environment(base={})
    assert (env["UCX_TLS"], env["AGENTKV_SECRET"]) == ("tcp", "s")


def test_default_connector_is_agentkvs() -> None:
    assert spec().connector is AGENTKV_CONNECTOR
    assert spec().url == "http://127.0.0.1:8200"


def test_a_test_model_is_served_in_the_dtype_it_was_built_in(tmp_path: Path) -> None:
    """vLLM's --dtype auto would serve fp32 weights as bf16."""
    (tmp_path / "agentkv_model.json").write_text('{"dtype": "float32"}')
    assert flag(spec(model=tmp_path).command(), "--dtype") == "float32"
    assert flag(spec(model=tmp_path, dtype="bfloat16").command(), "--dtype") == "bfloat16"
    assert "--dtype" not in spec(model=tmp_path / "other-model").command()


def test_engine_id_is_the_name_unless_vllm_should_draw_a_fresh_one() -> None:
    def transfer(engine: EngineSpec) -> dict[str, object]:
        return json.loads(flag(engine.command(), "--kv-transfer-config"))

    assert transfer(spec())["engine_id"] == "decode-8200"
    # A pod's restarted container keeps name, port and address: only a new id tells pullers.
    assert "engine_id" not in transfer(spec(fresh_engine_id=True))
    assert transfer(spec(fresh_engine_id=True))["kv_connector"] == "AgentKVConnector"


def test_engines_on_other_hosts_on_the_same_port_have_different_ids() -> None:
    """Reproduces the multi-host tier's two decode engines, both ``decode-8100`` on their own
    hosts: one peer to the prefill engine's NIXL, whose reads then went to the wrong one."""
    ids = {
        json.loads(flag(spec(host=host).command(), "--kv-transfer-config"))["engine_id"]
        for host in ("10.77.0.5", "10.77.0.6")
    }
    assert ids == {"decode-10.77.0.5-8200", "decode-10.77.0.6-8200"}


def test_an_engine_pinned_when_healthy_starts_unbound_with_its_thread_count() -> None:
    env = spec(cores="2-3", pin_when_healthy=True).environment(base={})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "2"


def test_parse_cores() -> None:
    assert parse_cores("1") == {1}
    assert parse_cores("0,2-3") == {0, 2, 3}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell apart")
def test_unplaced_threads_of_the_whole_tree_are_pinned_and_placed_ones_kept() -> None:
    """A process with a child: every thread that may run anywhere is pinned; a thread already
    narrowed (as NIXL's are by upstream) keeps its place."""
    cores = sorted(os.sched_getaffinity(0))
    script = (
        "import os, subprocess, sys, threading, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "def placed():\n"
        f"    os.sched_setaffinity(0, {{{cores[-1]}}}); time.sleep(60)\n"
        "threading.Thread(target=placed, daemon=True).start()\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print(child.pid, flush=True); time.sleep(60)\n"
    )
    with _process_tree(script) as (root, line):
        tree = [root, int(line)]
        threads = [int(t) for pid in tree for t in os.listdir(f"/proc/{pid}/task")]

        pinned = pin_unplaced_threads(root, {cores[0]})

        affinities = sorted(tuple(sorted(os.sched_getaffinity(t))) for t in threads)
        assert pinned == len(threads) - 1
        assert affinities.count((cores[0],)) == len(threads) - 1
        assert affinities.count((cores[-1],)) == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell apart")
def test_only_the_engine_core_process_is_pinned_to_its_engines_cores() -> None:
    """An API server with an engine core child (named as vLLM names it) and a worker child:
    the engine core's threads are pinned, the rest of the tree still runs anywhere."""
    everywhere = os.sched_getaffinity(0)
    core = min(everywhere)
    engine_core = (
        "import threading, time\n"
        "open('/proc/self/comm', 'w').write('VLLM::EngineCore')\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    script = (
        "import subprocess, sys, time\n"
        f"core = subprocess.Popen([sys.executable, '-c', {engine_core!r}], stdout=subprocess.PIPE)\n"
        "core.stdout.readline()\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(core.pid, worker.pid, flush=True); time.sleep(60)\n"
    )
    with _process_tree(script) as (root, line):
        core_pid, worker_pid = map(int, line.split())

        pinned = pin_engine_core(root, {core})

        core_threads = [int(t) for t in os.listdir(f"/proc/{core_pid}/task")]
        assert pinned == len(core_threads) == 2
        assert all(os.sched_getaffinity(t) == {core} for t in core_threads)
        assert os.sched_getaffinity(worker_pid) == everywhere
        assert os.sched_getaffinity(root) == everywhere


@contextlib.contextmanager
def _process_tree(script: str) -> Iterator[tuple[int, str]]:
    """Runs ``script`` in a new python process; yields its pid and the first line it prints
    (once its children are started), and kills it and its children after."""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield process.pid, process.stdout.readline()
    finally:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        process.wait()
