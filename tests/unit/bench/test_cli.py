"""``agentkv bench`` end to end against stub engines served from a thread of their own (the
command runs its own event loop)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from agentkv_server.bench import cli, cli_setup, engines
from agentkv_server.bench.agents12 import AgentSessions
from agentkv_server.bench.agents12_report import is_agents
from agentkv_server.bench.capacity import GIVEN
from agentkv_server.bench.modes import Deployment
from agentkv_server.bench.overload import OverloadWorkload
from agentkv_server.bench.overload_report import OVERLOAD_PLOT, is_overload
from agentkv_server.bench.paths import COST_PLOT, EXPECTED_PATH, PathSweep, is_path_sweep
from agentkv_server.bench.pressure_report import PRESSURE_PLOT
from agentkv_server.bench.records import BenchResult
from agentkv_server.bench.report import (
    JSON_NAME,
    MARKDOWN_NAME,
    SPEEDUP_PLOT,
    TRADE_PLOT,
    TTFT_PLOT,
)
from agentkv_server.bench.workload import PRESETS, WordTokenizer, agents_preset, overload_preset
from agentkv_server.testing import StubCluster, StubEngine, http_reporter

StartEngines = Callable[[StubCluster], Awaitable[tuple[StubEngine, StubEngine]]]
SECRET = "cli-test-secret"
SMALL = ["--sessions", "2", "--turns", "2", "--history-tokens", "300", "--new-tokens", "5",
         "--output-tokens", "3", "--tool-latency", "0", "--repeats", "1", "--no-progress"]  # fmt: skip


class StubThread:
    """A StubCluster running on an event loop in a background thread."""

    def __init__(self, router_port: int, start_engines: StartEngines) -> None:
        self._start_engines = start_engines
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster = self.call(self._start(router_port))

    def call(self, coroutine):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    async def _start(self, router_port: int) -> StubCluster:
        report, self._close_reporter = http_reporter(f"http://127.0.0.1:{router_port}", SECRET)
        cluster = StubCluster(model="stub-model", reporter=report)
        await self._start_engines(cluster)
        return cluster

    def engine(self, name: str) -> StubEngine:
        return next(e for e in self.cluster.engines if e.name == name)

    def close(self) -> None:
        self.call(self.cluster.close())
        self.call(self._close_reporter())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def router_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def stubs(router_port: int, start_engines: StartEngines) -> Iterator[StubThread]:
    stubs = StubThread(router_port, start_engines)
    yield stubs
    stubs.close()


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return cli.run(parser.parse_args(argv))


def test_every_mode_against_given_engines(
    stubs: StubThread, router_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench(
        *SMALL, "--prefill-url", stubs.engine("prefill").url, "--decode-url",
        stubs.engine("decode").url, "--router-port", str(router_port), "--secret", SECRET,
        "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0
    assert {p.name for p in tmp_path.iterdir()} >= {
        JSON_NAME,
        MARKDOWN_NAME,
        TTFT_PLOT,
        SPEEDUP_PLOT,
    }
    result = BenchResult.from_dict(json.loads((tmp_path / JSON_NAME).read_text()))
    assert result.config["model"] == "stub-model"  # asked from the engine
    per_mode = {m: [r for r in result.records if r.mode == m] for m in cli.MODES}
    assert all(len(records) == 4 and all(r.ok for r in records) for records in per_mode.values())
    assert any(r.kv_path == "local" for r in per_mode["agentkv"])  # short follow-ups
    summary = capsys.readouterr().out
    assert all(f"| {mode} |" in summary for mode in cli.MODES)


def test_warm_up_pulls_before_the_measured_turns_continue_locally(
    stubs: StubThread, router_port: int, tmp_path: Path
) -> None:
    """The measured agentkv turns go ``local``; only the warm-up (policy ``always``) pulls,
    so P's first pull from D happens before measuring."""
    code = bench(
        *SMALL, "--modes", "agentkv", "--prefill-url", stubs.engine("prefill").url,
        "--decode-url", stubs.engine("decode").url, "--router-port", str(router_port),
        "--secret", SECRET, "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0
    result = BenchResult.from_dict(json.loads((tmp_path / JSON_NAME).read_text()))
    assert {r.kv_path for r in result.records if r.turn > 1} == {"local"}
    assert stubs.engine("prefill").pulled  # the warm-up's follow-ups


def test_given_endpoint_measured_as_it_is(stubs: StubThread, tmp_path: Path) -> None:
    engine = stubs.engine("decode")
    code = bench(*SMALL, "--base-url", f"aggregated={engine.url}", "--out", str(tmp_path))
    assert code == 0
    result = BenchResult.from_dict(json.loads((tmp_path / JSON_NAME).read_text()))
    assert result.config["modes"] == ["aggregated"] and len(result.records) == 4
    warm_up_and_run = 3 + 4
    assert len(engine.completions()) == warm_up_and_run


def test_decoding_sessions_are_measured_and_reported(
    stubs: StubThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = stubs.engine("decode")
    argv = ["--base-url", f"aggregated={engine.url}", "--out", str(tmp_path)]
    code = bench(*SMALL, "--decoders", "1", "--decode-tokens", "10", *argv)
    assert code == 0
    result = BenchResult.from_dict(json.loads((tmp_path / JSON_NAME).read_text()))
    assert result.decodes and all(d.error is None for d in result.decodes)
    assert all(len(d.gaps_s) == 9 for d in result.decodes if d.complete)
    assert result.config["workload"]["decoders"] == 1
    assert "1 session(s) decoding 10-token outputs" in result.config["workload_text"]
    assert (tmp_path / TRADE_PLOT).is_file()
    assert "TPOT p99 (ms)" in capsys.readouterr().out


def test_failed_turns_make_the_exit_code_non_zero(stubs: StubThread, tmp_path: Path) -> None:
    engine = stubs.engine("decode")
    engine.faults.extend(["bad_request"] * 20)
    assert bench(*SMALL, "--base-url", f"aggregated={engine.url}", "--out", str(tmp_path)) == 1


def test_report_rendered_again_from_json(stubs: StubThread, tmp_path: Path) -> None:
    engine = stubs.engine("decode")
    bench(*SMALL, "--base-url", f"aggregated={engine.url}", "--out", str(tmp_path / "run"))
    again = tmp_path / "again"
    assert bench("--from-json", str(tmp_path / "run" / JSON_NAME), "--out", str(again)) == 0
    assert (again / MARKDOWN_NAME).read_text() == (tmp_path / "run" / MARKDOWN_NAME).read_text()


@pytest.mark.parametrize(
    "argv", [["--modes", "fastest"], ["--history-tokens", "1k"], ["--tool-latency", "soon:1"]]
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench(*argv)


def test_quick_selects_the_quick_preset() -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    assert parser.parse_args(["--quick"]).preset == "quick"
    assert parser.parse_args([]).preset == "cpu"


def test_unreachable_engine_is_reported_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench("--base-url", "aggregated=http://127.0.0.1:9", "--out", str(tmp_path))
    assert code == 2
    assert "pass --model" in capsys.readouterr().err


def test_negative_decoders_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench("--decoders", "-1", "--base-url", "aggregated=http://127.0.0.1:9") == 2
    assert "decoders must be >= 0" in capsys.readouterr().err


ENGINE_OPTIONS: dict[str, object] = {}
"""What bench asked ``local_engines`` for besides the model (local_stub_stack)."""


@pytest.fixture
def local_stub_stack(
    stubs: StubThread, router_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """``local_engines`` replaced by the stubs (with a tiny-long config.json as the model's
    directory); returns the models bench asked it to start."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256}
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    started: list[str] = []

    ENGINE_OPTIONS.clear()

    @contextlib.contextmanager
    def local_engines(
        model: str, log_dir: Path, **options: object
    ) -> Iterator[tuple[Deployment, Path]]:
        started.append(model)
        ENGINE_OPTIONS.update(options)
        decode = stubs.engine("decode").url
        yield (
            Deployment("stub-model", (stubs.engine("prefill").url,), (decode,), (decode,),
                       router_port, SECRET,
                       router_settings=options["router_settings"]),  # type: ignore[arg-type]
            model_dir,
        )  # fmt: skip

    monkeypatch.setattr(engines, "local_engines", local_engines)
    monkeypatch.setattr(cli_setup, "load_tokenizer", lambda path: WordTokenizer())
    return started


@pytest.mark.parametrize(("argv", "model"), [([], "tiny-long"), (["--model", "tiny"], "tiny")])
def test_preset_long_sweeps_each_path_on_the_local_stack(
    local_stub_stack: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    model: str,
) -> None:
    out = tmp_path / "out"
    code = bench("--preset", "long", "--history-tokens", "300,1200", *argv, "--out", str(out))
    assert code == 0
    assert local_stub_stack == [model]
    assert ENGINE_OPTIONS["decode_kv_tokens"] is None  # D gets all its KV cache
    data = json.loads((out / JSON_NAME).read_text())
    assert is_path_sweep(data) and data["config"]["kv_bytes_per_token"] == 8192
    sweep = PathSweep.from_dict(data)
    assert [(t.history_tokens, t.forced, t.kv_path) for t in sweep.turns] == [
        (history, forced, path) for history in (300, 1200) for forced, path in EXPECTED_PATH.items()
    ]
    assert all(t.router_cpu_s is not None and t.router_cpu_s > 0 for t in sweep.turns)
    assert (out / COST_PLOT).is_file()
    captured = capsys.readouterr()
    assert "| 1200 | reuse | reuse |" in captured.out
    assert "history 1200: turn 3/4 reuse -> reuse in" in captured.err  # progress per turn


def test_path_sweep_rendered_again_from_json(local_stub_stack: list[str], tmp_path: Path) -> None:
    bench(
        "--preset",
        "long",
        "--history-tokens",
        "300",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
    )
    again = tmp_path / "again"
    assert bench("--from-json", str(tmp_path / "run" / JSON_NAME), "--out", str(again)) == 0
    assert (again / MARKDOWN_NAME).read_text() == (tmp_path / "run" / MARKDOWN_NAME).read_text()


def test_preset_long_is_the_path_sweep_on_tiny_long() -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    long = cli._plan(parser.parse_args(["--preset", "long"]))
    assert long.measures == "paths" and long.model == "tiny-long"
    assert long.workload.history_tokens == (8000, 32000, 64000, 128000)
    assert cli._plan(parser.parse_args([])).measures == "modes"


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--sessions", "2"], "--sessions"), (["--modes", "agentkv"], "--modes"),
     (["--decoders", "1"], "--decoders"), (["--base-url", "http://127.0.0.1:9"], "--base-url")],
)  # fmt: skip
def test_preset_long_refuses_options_of_the_mode_comparison(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench("--preset", "long", *argv) == 2
    assert f"{named} do not apply" in capsys.readouterr().err


# A decode stub's KV cache for the pressure sweep: 62 blocks of 16 tokens.
_BLOCKS, _BLOCK_SIZE = 62, 16


async def _metered(self: StubEngine, request: web.Request) -> web.Response:
    """``/metrics`` with vLLM's KV usage, cache size and queue-time figures: what the stub
    retains is what it holds, and every request counts as scheduled at once."""
    counted = await _UNMETERED(self, request)
    held = sum(r.num_tokens for r in self.retained.values())
    requests = len(self.completions())
    text = (
        f"{counted.text}"
        f'vllm:kv_cache_usage_perc{{engine="0"}} {held / (_BLOCKS * _BLOCK_SIZE)}\n'
        f'vllm:cache_config_info{{block_size="{_BLOCK_SIZE}",engine="0",'
        f'num_gpu_blocks="{_BLOCKS}"}} 1.0\n'
        f'vllm:request_queue_time_seconds_bucket{{engine="0",le="1.0"}} {requests}\n'
        f'vllm:request_queue_time_seconds_count{{engine="0"}} {requests}\n'
        f'vllm:num_preemptions_total{{engine="0"}} 0.0\n'
    )
    return web.Response(text=text, content_type="text/plain")


_UNMETERED = StubEngine._metrics


@pytest.fixture
def metered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StubEngine, "_metrics", _metered)


def test_preset_pressure_sweeps_the_modes_beside_the_clairvoyant(
    metered: None,
    stubs: StubThread,
    local_stub_stack: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTKV_TIMEOUTS__TOKENIZE_S", "2")  # for the routers, as agentkv router
    modes = ("aggregated", "recompute", "agentkv", "upstream-best")
    # Every decode step says holdings kept it waiting for blocks, as agentkv's connector would.
    stubs.engine("decode").blocks_wait = (1.5, 1.0)
    out = tmp_path / "out"
    shape = ["--session-counts", "2,4", "--history-tokens", "300,400", "--turns", "3",
             "--new-tokens", "5", "--output-tokens", "3", "--tool-latency", "lognormal:0.02",
             "--start-spread", "0.5"]  # fmt: skip
    code = bench("--preset", "pressure", *shape, "--modes", ",".join(modes), "--out", str(out))
    assert code == 0
    assert local_stub_stack == ["smollm2"]
    # the preset's small decode cache, and aggregated's own engine asked for
    assert ENGINE_OPTIONS["decode_kv_tokens"] == 8192 and ENGINE_OPTIONS["aggregated"] is True
    data = json.loads((out / JSON_NAME).read_text())
    assert data["config"]["measures"] == "pressure"
    tuned = {"timeouts": {"tokenize_s": "2"}}
    assert data["config"]["router_settings"] == ENGINE_OPTIONS["router_settings"] == tuned
    rows = {(r["mode"], r["sessions"]): r for r in data["pressure"]}
    assert set(rows) == {(mode, n) for mode in modes for n in (2, 4)}
    result = BenchResult.from_dict(data)
    assert {(w.mode, w.sessions) for w in result.windows} == set(rows)
    assert all(w.capacity_tokens == _BLOCKS * _BLOCK_SIZE for w in result.windows)
    assert all(w.waited_requests == 0 and w.decode_requests for w in result.windows)
    # Counted by each mode's router; aggregated has none to count them.
    assert all(
        (w.waited_beside_holdings is None) == (w.mode == "aggregated") for w in result.windows
    )
    for window in (w for w in result.windows if w.mode == "agentkv"):
        assert window.waited_beside_holdings and window.waited_beside_holdings_s
        assert window.waited_beside_holdings_s == 1.5 * window.waited_beside_holdings
    for (mode, n), row in rows.items():
        assert row["failed"] == 0 and row["turns"] == 3 * n
        assert row["clairvoyant_followups"] == row["followups"] > 0
        assert row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
    assert rows[("recompute", 4)]["share"] == 0.0
    # every missed follow-up with the router's reason for it (aggregated has no router)
    missed = rows[("recompute", 4)]["missed"]
    assert sum(missed.values()) == rows[("recompute", 4)]["followups"] and "?" not in missed
    assert rows[("upstream-best", 2)]["share"] == 1.0  # streamed turns reused, room for both
    assert all(0 < row["clairvoyant_share"] <= 1.0 for row in rows.values())
    assert (out / PRESSURE_PLOT).is_file()
    captured = capsys.readouterr()
    assert "| 4 | upstream-best |" in captured.out and "clairvoyant" in captured.out
    assert "4 sessions, agentkv 1:" in captured.err  # progress per run
    again = tmp_path / "again"
    assert bench("--from-json", str(out / JSON_NAME), "--out", str(again)) == 0
    assert (again / MARKDOWN_NAME).read_text() == (out / MARKDOWN_NAME).read_text()


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--sessions", "2"], "--sessions"), (["--decoders", "1"], "--decoders"),
     (["--tool-latency", "fixed:1"], "lognormal")],
)  # fmt: skip
def test_preset_pressure_refuses_what_does_not_apply(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench("--preset", "pressure", *argv) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--session-counts", "--start-spread"])
def test_pressure_options_belong_to_the_pressure_sweep(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench(option, "2", "--base-url", "aggregated=http://127.0.0.1:9") == 2
    assert f"{option} is a pressure sweep's option" in capsys.readouterr().err


def test_a_negative_start_spread_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench("--preset", "pressure", "--start-spread", "-1") == 2
    assert "start spread must be >= 0 seconds" in capsys.readouterr().err


# --- the overload and agents12 presets ------------------------------------------------------

SMALL_OVERLOAD = OverloadWorkload(
    loads=(0.0, 1.0, 2.0, 4.0), objective_s=5.0, history_tokens=(200, 300), new_tokens=5,
    output_tokens=3, turns=(2, 2), bursts=1, burst_period_s=0.3, burst_window_s=0.05,
    lead_in_s=0.1, gap_median_s=0.02, steady_sessions=1, steady_gap_median_s=0.05,
    calibration_turns=2,
)  # fmt: skip


@pytest.fixture
def small_overload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PRESETS, "overload", overload_preset("small", SMALL_OVERLOAD))


def test_preset_overload_measures_the_capacity_then_every_load_per_mode(
    small_overload: None, stubs: StubThread, router_port: int, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = tmp_path / "out"
    code = bench(
        "--preset", "overload", "--prefill-url", stubs.engine("prefill").url, "--decode-url",
        stubs.engine("decode").url, "--router-port", str(router_port), "--secret", SECRET,
        "--loads", "0,1,2", "--out", str(out),
    )  # fmt: skip
    assert code == 0
    data = json.loads((out / JSON_NAME).read_text())
    assert is_overload(data) and data["config"]["modes"] == [
        "aggregated",
        "agentkv",
        "upstream-best",
    ]
    capacity = data["config"]["capacity"]
    assert len(capacity["prompt_tokens"]) == 2 and capacity["tokens_per_s"] > 0
    assert "cold turns" in capacity["method"] and data["config"]["overload"]["loads"] == [0, 1, 2]
    rows = {(r["mode"], r["load"]): r for r in data["rows"]}
    assert set(rows) == {
        (m, x) for m in ("aggregated", "agentkv", "upstream-best") for x in (0, 1, 2)
    }
    assert all(r["figures"]["failed"] == 0 and r["figures"]["served"] for r in rows.values())
    assert rows[("agentkv", 2.0)]["burst_size"] > rows[("agentkv", 1.0)]["burst_size"] > 0
    assert {c["mode"] for c in data["checks"]} == {"aggregated", "agentkv", "upstream-best"}
    assert (out / OVERLOAD_PLOT).is_file()
    captured = capsys.readouterr()
    assert "| 2x | agentkv |" in captured.out and "Bars (issue 48)" in captured.out
    assert "capacity:" in captured.err and "x1, upstream-best 1:" in captured.err
    again = tmp_path / "again"
    assert bench("--from-json", str(out / JSON_NAME), "--out", str(again)) == 0
    assert (again / MARKDOWN_NAME).read_text() == (out / MARKDOWN_NAME).read_text()


def test_preset_overload_takes_a_capacity_given_instead_of_measuring_it(
    small_overload: None, stubs: StubThread, router_port: int, tmp_path: Path
) -> None:
    code = bench(
        "--preset", "overload", "--prefill-url", stubs.engine("prefill").url, "--decode-url",
        stubs.engine("decode").url, "--router-port", str(router_port), "--secret", SECRET,
        "--modes", "agentkv", "--loads", "1", "--capacity", "3000", "--objective", "4",
        "--request-timeout", "40", "--no-progress", "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0
    config = json.loads((tmp_path / JSON_NAME).read_text())["config"]
    assert config["capacity"] == {"tokens_per_s": 3000.0, "method": GIVEN, "prompt_tokens": [],
                                  "seconds": []}  # fmt: skip
    assert config["modes"] == ["agentkv"] and config["overload"]["objective_s"] == 4.0
    assert config["overload"]["turn_timeout_s"] == 40.0 and config["client_timeout_s"] == 50.0
    assert not [r for r in stubs.engine("prefill").completions() if "calibrate" in str(r.body)]


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--preset", "cpu", "--loads", "1"], "--loads is an overload option"),
     (["--preset", "overload", "--sessions", "2"], "--sessions does not apply"),
     (["--preset", "overload", "--base-url", "http://127.0.0.1:9"], "--base-url does not apply"),
     (["--preset", "overload", "--tool-latency", "fixed:1"], "lognormal"),
     (["--preset", "overload", "--loads", "-1"], "loads must be >= 0"),
     (["--preset", "overload", "--capacity", "0"], "more than 0"),
     (["--preset", "agents12", "--history-tokens", "1,2"], "one length"),
     (["--preset", "agents12", "--decoders", "1"], "--decoders does not apply")],
)  # fmt: skip
def test_preset_overload_and_agents12_refuse_what_does_not_apply(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench(*argv) == 2
    assert named in capsys.readouterr().err


def test_preset_agents12_runs_the_issues_sessions_on_the_engines_agentkv_serve_starts(
    local_stub_stack: list[str], stubs: StubThread, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    agents = AgentSessions(sessions=3, history_tokens=200, turns=2, new_words=7,
                           output_tokens=3, fast_gap_s=0.02, slow_gap_s=0.05,
                           start_every_s=0.01)  # fmt: skip
    monkeypatch.setitem(PRESETS, "agents12", agents_preset("small", agents))
    out = tmp_path / "out"
    assert bench("--preset", "agents12", "--out", str(out)) == 0
    assert local_stub_stack == ["smollm2"] and ENGINE_OPTIONS["prefill_prefix_cache"] is True
    data = json.loads((out / JSON_NAME).read_text())
    assert is_agents(data) and data["config"]["modes"] == ["agentkv"]
    everything = data["rows"][0]
    assert (everything["kind"], everything["figures"]["turns"]) == (None, 6)
    assert everything["figures"]["failed"] == 0 and everything["marked_down"] in (0, None)
    users = [m["content"] for r in stubs.engine("decode").completions()
             for m in r.body["messages"] if m["role"] == "user"]  # fmt: skip
    assert users and all(len(text.split()) == 7 for text in users)  # fresh input in words
    assert "| agentkv | idle |" in capsys.readouterr().out
