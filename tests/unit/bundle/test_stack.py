"""Stack planning that needs no engine: core layout and configuration checks."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from agentkv_server.bundle.launcher import EngineSpec, Role
from agentkv_server.bundle.model import tool_call_logit_bias
from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.stack import Stack, StackConfig, core_layout
from agentkv_server.errors import ConfigError

P, D = "prefill", "decode"


@pytest.mark.parametrize(
    ("roles", "cores", "layout"),
    [
        ([P, D], [0, 1], ["0", "1"]),
        ([P, D], [0, 1, 2, 3], ["0-1", "2-3"]),
        ([P, D, D], [0, 1, 2, 3, 4, 5, 6], ["0-1", "2-3", "4-5"]),
        ([P, D], [0, 2, 4, 6], ["0,2", "4,6"]),
        ([D], [5], ["5"]),
        ([D, D, D], [0, 1], ["0", "1", "0"]),
        ([P, D], [3], ["3", "3"]),
    ],
)
def test_core_layout(roles: list[Role], cores: list[int], layout: list[str]) -> None:
    assert core_layout(roles, cores) == layout


@pytest.mark.parametrize(
    ("roles", "cores", "layout"),
    [
        ([P, D, D], [0, 1], ["0", "1", "1"]),  # agentkv serve --decode-engines 2 on 2 cores
        ([P, P, D, D], [0, 1], ["0", "0", "1", "1"]),
        ([P, D, D, D, D], [0, 1, 2, 3], ["0", "1", "2", "3", "1"]),
        ([P, P, P, D], [0, 1, 2], ["0", "1", "0", "2"]),
    ],
)
def test_prefill_and_decode_engines_never_share_a_core(
    roles: list[Role], cores: list[int], layout: list[str]
) -> None:
    """A KV read stalls while its reader busy-polls on the holder's core (docs/faults.md)."""
    assert core_layout(roles, cores) == layout
    prefill = {layout[i] for i, role in enumerate(roles) if role == P}
    assert prefill.isdisjoint(layout[i] for i, role in enumerate(roles) if role == D)


def test_core_layout_needs_a_core() -> None:
    with pytest.raises(ConfigError):
        core_layout([P, D], [])


def test_a_stack_needs_a_decode_engine() -> None:
    with pytest.raises(ConfigError):
        StackConfig(decode=0)
    with pytest.raises(ConfigError):
        StackConfig(prefill=-1)


def test_each_stack_gets_its_own_secret() -> None:
    assert StackConfig().secret != StackConfig().secret
    assert "secret" not in repr(StackConfig())


def test_plan_gives_each_engine_its_own_ports_cores_and_log(tmp_path: Path) -> None:
    (router_port,) = free_ports(1)  # plan() checks the router's port: not 8000, maybe taken
    config = StackConfig(
        model=str(tmp_path),
        prefill=1,
        decode=2,
        port=router_port,
        cpu_cores=(0, 1, 2, 3, 4, 5),
        log_dir=tmp_path,
    )
    specs = Stack(config).plan()
    assert [spec.role for spec in specs] == ["prefill", "decode", "decode"]
    assert [spec.cores for spec in specs] == ["0-1", "2-3", "4-5"]
    ports = [port for spec in specs for port in (spec.port, spec.side_channel_port)]
    assert len(set(ports)) == 6 and config.port not in ports
    assert len({spec.log_path for spec in specs}) == 3
    assert {spec.served_name for spec in specs} == {tmp_path.name}
    for spec in specs:
        assert spec.env == {
            "AGENTKV_ROUTER_URL": f"http://127.0.0.1:{router_port}",
            "AGENTKV_SECRET": config.secret,
        }


def test_the_router_runs_at_the_stacks_log_level(tmp_path: Path) -> None:
    stack = Stack(StackConfig(model=str(tmp_path), router_log_level="debug", log_dir=tmp_path))
    command = stack.router_command(tmp_path / "router-settings.json")
    assert command[command.index("--log-level") + 1] == "debug"
    assert command[command.index("--config") + 1] == str(tmp_path / "router-settings.json")


def test_only_decode_engines_get_the_host_tier(tmp_path: Path) -> None:
    config = StackConfig(model=str(tmp_path), router=False, host_tier_gib=2.0, log_dir=tmp_path)
    tiers = {spec.role: spec.host_tier_gib for spec in Stack(config).plan()}
    assert tiers == {"prefill": 0.0, "decode": 2.0}


def test_plan_without_router_reports_nowhere_and_gpu_binds_no_cores(tmp_path: Path) -> None:
    config = StackConfig(model=str(tmp_path), router=False, device="cuda", log_dir=tmp_path)
    specs = Stack(config).plan()
    assert all(spec.env == {} and spec.cores is None for spec in specs)


def test_plan_for_a_router_started_elsewhere_as_bench_runs_it(tmp_path: Path) -> None:
    """Prefill-only arguments reach prefill engines only; decode engines report to the port
    where the bench's routers will listen, though the stack starts none."""
    config = StackConfig(
        model=str(tmp_path),
        log_dir=tmp_path,
        engine_args=("--max-model-len", "4096"),
        prefill_args=("--no-enable-prefix-caching",),
        router=False,
        report_port=9123,
    )
    prefill, decode = Stack(config).plan()
    assert prefill.engine_args == (
        *config.prefill_step_args,
        "--max-model-len",
        "4096",
        "--no-enable-prefix-caching",
    )
    assert decode.engine_args == (*config.slice_args, "--max-model-len", "4096")
    assert decode.env["AGENTKV_ROUTER_URL"] == "http://127.0.0.1:9123"
    assert decode.command()[-2:] == ["--max-model-len", "4096"]


@pytest.mark.parametrize("slice_tokens", [0, 48])
def test_decode_engines_slice_prefills_as_the_router_prices_them(
    tmp_path: Path, slice_tokens: int
) -> None:
    """The router prices a local turn on a busy holder per slice (local.slice_tokens): its
    decode engines cut prefills beside running sequences at that size; the user's own engine
    arguments come after, so that they can override."""
    _, decode = planned(tmp_path, {"local": {"slice_tokens": slice_tokens}})
    sliced = ("--long-prefill-token-threshold", "48") if slice_tokens else ()
    assert decode.engine_args == (*sliced, "--max-model-len", "4096")


@pytest.mark.parametrize("step_tokens", [0, 512])
def test_prefill_engines_take_steps_no_longer_than_the_router_holds_turns_behind(
    tmp_path: Path, step_tokens: int
) -> None:
    """A follow-up the router sends ahead of queued first turns waits for the step its prefill
    engine computes (admission.prefill_step_tokens), not for a whole long prompt."""
    prefill, decode = planned(tmp_path, {"admission": {"prefill_step_tokens": step_tokens}})
    stepped = (
        ("--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "256")
        if step_tokens
        else ()
    )
    assert prefill.engine_args == (*stepped, "--max-model-len", "4096")
    assert "--max-num-batched-tokens" not in decode.engine_args


def test_a_long_context_test_model_gets_kv_cache_for_a_full_length_sequence(
    tiny_long: Path,
) -> None:
    """tiny-long's 131,072 tokens take 1 GiB of fp32 KV: vLLM would refuse the default 1 GiB."""
    config = StackConfig(model=str(tiny_long), log_dir=tiny_long, router=False)
    assert (config.kv_cache_gib, config.engine_kv_cache_gib) == (1, 2)
    specs = Stack(config).plan()
    assert {spec.environment({})["VLLM_CPU_KVCACHE_SPACE"] for spec in specs} == {"2"}
    note = config.kv_cache_note()
    assert note is not None
    assert "2 GiB of KV cache" in note and "131072-token sequence of tiny-long" in note


def test_kv_cache_is_raised_only_where_the_model_needs_it() -> None:
    assert StackConfig(model="tiny-long").engine_kv_cache_gib == 2  # by name, nothing built
    assert StackConfig(model="tiny-long", dtype="bfloat16").engine_kv_cache_gib == 1
    assert StackConfig(model="tiny-long", kv_cache_gib=4).engine_kv_cache_gib == 4
    for config in (
        StackConfig(model="tiny-long", kv_cache_gib=4),
        StackConfig(model="tiny-long", device="cuda"),  # no VLLM_CPU_KVCACHE_SPACE on a GPU
        StackConfig(model="tiny"),
        StackConfig(),
    ):
        assert config.kv_cache_note() is None
    assert StackConfig(model="tiny").engine_kv_cache_gib == 1


def test_client_environment_carries_the_test_models_logit_bias(tiny: Path) -> None:
    stack = Stack(StackConfig(model=str(tiny), port=8123))
    stack.plan()
    env = stack.client_environment()
    assert env["AGENTKV_BASE_URL"] == "http://127.0.0.1:8123/v1"
    assert env["AGENTKV_MODEL"] == tiny.name
    assert json.loads(env["AGENTKV_TOOL_LOGIT_BIAS"]) == tool_call_logit_bias(tiny)


def test_client_environment_of_any_other_model_has_no_logit_bias(tmp_path: Path) -> None:
    stack = Stack(StackConfig(model=str(tmp_path), port=8123))
    stack.plan()
    assert "AGENTKV_TOOL_LOGIT_BIAS" not in stack.client_environment()


# Stands in for an engine (a module: engines run as `python -m`): the first start reports a port clash and lingers (as a vLLM engine
# whose NIXL side channel failed to bind does); later starts serve /health on their port.
CLASHES_ONCE = """
import http.server, pathlib, sys, time
port, first = int(sys.argv[1]), pathlib.Path(sys.argv[2])
if not first.exists():
    first.write_text(str(port))
    print("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')", flush=True)
    time.sleep(60)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_an_engine_whose_port_was_taken_starts_again_on_other_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "first-port"
    (tmp_path / "clashes_once.py").write_text(CLASHES_ONCE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setattr(
        EngineSpec,
        "command",
        lambda spec: [sys.executable, "-m", "clashes_once", str(spec.port), str(marker)],
    )
    stack = Stack(StackConfig(model=str(tmp_path), prefill=0, router=False, log_dir=tmp_path))
    started = time.monotonic()
    with stack:
        assert time.monotonic() - started < 30
        (engine,) = stack.engines
        assert engine.is_running()
        assert engine.spec.port != int(marker.read_text())


def planned(tmp_path: Path, router_settings: dict):
    """The (prefill, decode) engines a stack with ``router_settings`` and the user's own
    ``--max-model-len 4096`` starts."""
    config = StackConfig(
        model=str(tmp_path),
        log_dir=tmp_path,
        engine_args=("--max-model-len", "4096"),
        router_settings=router_settings,
    )
    return Stack(config).plan()
