"""``agentkv bench router``: its options beside plain ``agentkv bench``, the binaries it needs,
its rows and tables. Nothing here starts a stub engine or a router."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.bench import router
from agentkv_server.bench.router import DIRECT, LoadResult, Row, Target
from agentkv_server.bench.router_sessions import (
    SessionLoadResult,
    TurnRecord,
    decisions_table,
    session_table,
)
from agentkv_server.cli import build_parser, main
from agentkv_server.errors import ConfigError

ALL_FOUND = {"wrk": "/usr/bin/wrk", "vllm-router": "/opt/vr/bin/vllm-router", "py-spy": "/x/py-spy"}


def parse(*argv: str) -> argparse.Namespace:
    full = ["bench", *argv]
    return build_parser(full).parse_args(full)


def which(found: dict[str, str]):  # type: ignore[no-untyped-def]
    """shutil.which over ``found`` (a name, or a path that is its own value)."""
    return lambda name: found.get(name) or (name if name in found.values() else None)


def plan(*argv: str, found: dict[str, str] = ALL_FOUND, redis: bool = True) -> router.Plan:
    return router.plan(parse("router", *argv), which=which(found), redis_available=lambda: redis)


# --- the command line -------------------------------------------------------------------------


def test_router_options_and_defaults() -> None:
    args = parse("router", "--only", "agentkv", "--concurrency", "1", "--duration", "2")
    assert args.bench_command == "router"
    assert (args.only, args.concurrency, args.duration) == (["agentkv"], [1], 2.0)
    args = parse("router")
    assert args.only is None and args.load == "wrk" and args.concurrency == [1, 32]
    assert (args.duration, args.warmup, args.stream, args.replicas) == (10.0, 2.0, ["no", "yes"], 2)
    assert args.baseline == [] and args.out is None and args.profile is None


def test_plain_bench_is_unchanged() -> None:
    args = parse("--preset", "quick", "--modes", "agentkv,recompute", "--concurrency", "3")
    assert args.bench_command is None
    assert (args.preset, args.concurrency) == ("quick", 3)
    assert parse("--quick").preset == "quick"


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "nothing"],
        ["--load", "curl"],
        ["--concurrency", "0"],
        ["--duration", "0"],
        ["--stream", "maybe"],
        ["--replicas", "0"],
    ],
)
def test_bad_router_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse("router", *argv)
    assert exit_info.value.code == 2


def test_router_help_works(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "router", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "agentkv bench router" in out and "--vllm-router" in out and "--load" in out


def test_every_router_option_has_help() -> None:
    parser = argparse.ArgumentParser()
    router.configure(parser)
    missing = [
        a.option_strings
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert missing == []


# --- the binaries it needs --------------------------------------------------------------------


def test_everything_found_runs_the_default_targets() -> None:
    chosen = plan()
    assert chosen.targets == router.DEFAULT_TARGETS and chosen.skipped == ()
    assert (chosen.wrk, chosen.vllm_router) == ("/usr/bin/wrk", "/opt/vr/bin/vllm-router")


def test_missing_wrk_is_named_with_how_to_install_it() -> None:
    with pytest.raises(ConfigError) as error:
        plan("--only", "agentkv", found={})
    message = str(error.value)
    assert message.startswith("wrk not found")
    assert "apt-get install wrk" in message and "--load python" in message


def test_python_load_needs_no_wrk() -> None:
    chosen = plan("--load", "python", "--only", "direct", "agentkv", found={})
    assert chosen.wrk is None and chosen.targets == ("direct", "agentkv")


def test_only_row_targets_need_wrk() -> None:
    assert plan("--only", "decisions", "sessions", found={}).wrk is None


def test_default_run_leaves_out_what_it_cannot_start_and_says_so() -> None:
    chosen = plan(found={"wrk": "/usr/bin/wrk"}, redis=False)
    assert chosen.targets == ("direct", "agentkv")
    assert len(chosen.skipped) == 2
    rust, redis = chosen.skipped
    assert "vllm-router not found" in rust and "pip install vllm-router" in rust
    assert "--vllm-router" in rust
    assert "redis-server not found" in redis and "apt-get install redis-server" in redis


@pytest.mark.parametrize(
    "argv",
    [["--only", "rust"], ["--vllm-router", "/nowhere/vllm-router"]],
    ids=["asked-for", "path-given"],
)
def test_vllm_router_asked_for_and_missing_is_an_error(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match="vllm-router not found.*pip install vllm-router"):
        plan(*argv, found={"wrk": "/usr/bin/wrk"})


def test_a_vllm_router_path_given_is_used() -> None:
    found = {"wrk": "/usr/bin/wrk", "/tmp/vr/bin/vllm-router": "/tmp/vr/bin/vllm-router"}
    chosen = plan("--vllm-router", "/tmp/vr/bin/vllm-router", found=found)
    assert "rust" in chosen.targets and chosen.vllm_router == "/tmp/vr/bin/vllm-router"


def test_replicas_asked_for_without_redis_is_an_error() -> None:
    with pytest.raises(ConfigError, match="redis-server not found"):
        plan("--only", "replicas", redis=False)
    with pytest.raises(ConfigError, match="--replicas 2"):
        plan("--only", "replicas", "--replicas", "1")
    assert plan("--replicas", "1").skipped == ("replicas left out: --replicas 1",)


def test_profile_needs_py_spy_and_an_agentkv_target() -> None:
    with pytest.raises(ConfigError, match="py-spy not found.*pip install py-spy"):
        plan("--only", "agentkv", "--profile", "/tmp/p", found={"wrk": "/usr/bin/wrk"})
    with pytest.raises(ConfigError, match="add agentkv"):
        plan("--only", "direct", "--profile", "/tmp/p")
    assert plan("--only", "agentkv", "--profile", "/tmp/p").py_spy == "/x/py-spy"


def test_a_missing_binary_stops_the_command_with_usage_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["bench", "router", "--only", "agentkv", "--wrk", "/nowhere/wrk"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("agentkv bench router: wrk not found ('/nowhere/wrk' is not an")


# --- rows and tables --------------------------------------------------------------------------


def test_wrk_result_is_read_from_its_json_line() -> None:
    output = "Running 2s test\n  1 threads\n\nWRK-JSON " + json.dumps(
        {"requests": 200, "duration_us": 2_000_000, "p50_us": 1500, "p99_us": 4200, "errors": 1}
    )
    assert router.wrk_result(output) == LoadResult(200, 1, 2.0, 1.5, 4.2)
    with pytest.raises(Exception, match="wrk printed no result"):
        router.wrk_result("unable to connect to 127.0.0.1:9")


def test_direct_body_carries_the_decode_steps_params() -> None:
    direct = json.loads(router.request_body(stream=True, direct=True))
    routed = json.loads(router.request_body(stream=False, direct=False))
    assert direct["stream"] is True and "stream" not in routed
    assert wire.KV_TRANSFER_PARAMS in direct and wire.KV_TRANSFER_PARAMS not in routed
    assert direct[wire.KV_TRANSFER_PARAMS][wire.DO_REMOTE_PREFILL] is True


def test_a_row_sums_its_replicas_and_takes_the_worse_percentiles() -> None:
    target = Target("agentkv P/D", ["http://a", "http://b"], [1, 2], 3, sessions=True)
    results = [LoadResult(1000, 0, 2.0, 1.0, 3.0), LoadResult(600, 2, 2.5, 1.5, 2.0)]
    row = router.row_of(
        target, True, results, connections=16, cpu_s=0.8, stub_cpu_s=0.4, paths={"local": 5, "x": 0},
        load="python",
    )  # fmt: skip
    assert (row.concurrency, row.requests, row.errors) == (32, 1600, 2)
    assert row.requests_per_s == pytest.approx(640.0)
    assert (row.p50_ms, row.p99_ms) == (1.5, 3.0)
    assert row.cpu_us_per_request == pytest.approx(500.0)
    assert row.stub_cpu_us_per_request == pytest.approx(250.0)
    assert row.paths == {"local": 5} and row.load == "python"


def test_the_direct_row_has_no_router_cpu() -> None:
    target = Target(DIRECT, ["http://d"], [], 3)
    row = router.row_of(
        target, False, [LoadResult(10, 0, 1.0, 0.2, 0.4)], connections=1, cpu_s=0.0,
        stub_cpu_s=0.001, paths={}, load="wrk",
    )  # fmt: skip
    assert row.cpu_us_per_request is None


def _row(target: str, p50: float, *, stream: bool = False, c: int = 1, cpu: float | None = 300.0):
    return Row(target, stream, c, 100, 0, 50.0, p50, 2 * p50, cpu, 120.0, {})


def test_table_adds_p50_over_the_direct_row_of_the_same_kind() -> None:
    rows = [
        _row(DIRECT, 0.16, cpu=None),
        _row("agentkv P/D", 0.60),
        _row("agentkv P/D", 0.95, stream=True),  # no direct streamed row
    ]
    rows[1] = replace(rows[1], paths={"recompute": 7, "local": 3})
    lines = router.table(rows).splitlines()
    assert lines[0] == router.HEADER.splitlines()[0]
    assert len(lines) == 2 + len(rows)
    assert lines[2] == "| stub D step | no | 1 | 50 | 0.16 | 0.32 | - | - | 120 | 0 | - |"
    assert lines[3] == (
        "| agentkv P/D | no | 1 | 50 | 0.60 | 1.20 | +0.44 | 300 | 120 | 0 | local 3, recompute 7 |"
    )
    assert "| yes | 1 | 50 | 0.95 | 1.90 | - |" in lines[4]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_decisions_and_session_tables() -> None:
    turns = [TurnRecord("agent-2k", 1, 2006, "recompute", 0, 408.04)]
    assert (
        decisions_table(turns).splitlines()[-1] == "| agent-2k | 1 | 2006 | recompute | 0 | 408.0 |"
    )
    loads = [
        SessionLoadResult("direct P+D, prefill 0 us/token", 32, 10, 10, None, 100.0, 8.0, 60.0, {}),
        SessionLoadResult(
            "router, prefill 0 us/token", 32, 10, 10, 10, 90.0, 14.5, 28.0,
            {"local": 8, "recompute": 2, "None": 0}, 6, (86.0, 88.4, 88.0),
        ),
    ]  # fmt: skip
    text = session_table(loads, 64)
    assert "max held (bound 64)" in text
    assert "| router, prefill 0 us/token | 32 | 10 | 10 | 10 | 90 | 14.5 | 28.0 | local 8, " in text
    assert "| 6 | 86/88/88 |" in text
    assert text.endswith("the router adds 6.5 ms p50 and -32.0 ms p99 per turn at concurrency 32.")


# --- the Python load --------------------------------------------------------------------------


async def test_python_load_is_a_closed_loop_with_one_session_per_connection(
    aiohttp_server_factory,
) -> None:
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get(protocol.HEADER_SESSION_ID))
        await request.read()
        return web.json_response({"ok": True}, status=200 if len(seen) % 10 else 500)

    url = await aiohttp_server_factory(answer)
    result = await router.python_load(url + router.PATH, "{}", 2, 2, 0.3, 7)
    assert result.requests == len(seen) > 10
    assert result.errors == len(seen) // 10
    assert 0.3 <= result.seconds < 1.0
    assert 0 < result.p50_ms <= result.p99_ms
    assert set(seen) == {"bench-7-0-0", "bench-7-0-1"}


@pytest.fixture
async def aiohttp_server_factory():  # type: ignore[no-untyped-def]
    runners: list[web.AppRunner] = []

    async def start(handler) -> str:  # type: ignore[no-untyped-def]
        app = web.Application()
        app.router.add_post(router.PATH, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def test_out_is_a_json_file(tmp_path: Path) -> None:
    args = parse("router", "--out", str(tmp_path / "rows.json"))
    assert args.out == tmp_path / "rows.json"
