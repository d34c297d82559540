"""Ctrl-C and SIGTERM stop ``agentkv bench``: a real ``agentkv bench`` process against stub
engines in a process of their own, interrupted the way a terminal (SIGINT to its process group)
or a process manager (SIGTERM) does.

Reproduces two reports: Ctrl-C in a terminal ended bench with a traceback and status -2, and a
bench started in the background (SIGINT ignored, as a shell does for ``&``) went on to its end
after SIGINT with the turns in flight failed: the routers bench serves in its own event loop
took the signal for themselves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv_server.bench.report import JSON_NAME
from agentkv_server.bundle.ports import free_ports
from agentkv_server.testing.conditions import wait_healthy

SECRET = "interrupt-test-secret"
# The stub prefill takes about 1 s a turn (300 tokens at 3 ms), so a signal comes while a turn
# is in flight; with the warm-up, eight turns in two modes take some 30 s.
PREFILL_US_PER_TOKEN = 3_000
LONG_RUN = ["--modes", "recompute,agentkv", "--sessions", "1", "--turns", "8",
            "--history-tokens", "300", "--new-tokens", "5", "--output-tokens", "3",
            "--tool-latency", "fixed:0.2", "--repeats", "1", "--no-progress"]  # fmt: skip
STOPPED_WITHIN_S = 20.0
# `agentkv` with SIGINT as a terminal's foreground job has it (Python's default handler) or as
# a shell starts a job with `&` (ignored from the start), whatever this test process inherited.
_AGENTKV = (
    "import signal, sys; signal.signal(signal.SIGINT, {}); "
    "from agentkv_server.cli import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.fixture
def stub_engines() -> Iterator[tuple[str, str, int]]:
    """Prefill and decode stub URLs, reporting holdings to a router port bench will use."""
    (router_port,) = free_ports(1)
    stubs = subprocess.Popen(
        [sys.executable, "-m", "agentkv_server.testing", "--engines", "2", "--router-url",
         f"http://127.0.0.1:{router_port}", "--secret", SECRET, "--prefill-us-per-token",
         str(PREFILL_US_PER_TOKEN)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert stubs.stdout is not None
        prefill, decode = json.loads(stubs.stdout.readline())
        yield prefill, decode, router_port
    finally:
        stubs.terminate()
        stubs.wait(15)


def _start_bench(
    engines: tuple[str, str, int], out: Path, *extra: str, ignore_sigint: bool = False
) -> subprocess.Popen[str]:
    prefill, decode, router_port = engines
    sigint = "signal.SIG_IGN" if ignore_sigint else "signal.default_int_handler"
    agentkv = [sys.executable, "-c", _AGENTKV.format(sigint)]
    return subprocess.Popen(
        [*agentkv, "bench", *LONG_RUN, "--prefill-url", prefill, "--decode-url", decode,
         "--router-port", str(router_port), "--secret", SECRET, "--out", str(out), *extra],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip


@pytest.mark.parametrize(
    ("signum", "to_group", "background"),
    [(signal.SIGINT, True, False), (signal.SIGTERM, False, False), (signal.SIGTERM, False, True)],
    ids=["ctrl-c", "sigterm", "sigterm-to-a-background-job"],
)
def test_a_signal_stops_the_run_and_writes_no_results(
    stub_engines: tuple[str, str, int],
    tmp_path: Path,
    signum: signal.Signals,
    to_group: bool,
    background: bool,
) -> None:
    out = tmp_path / "out"
    bench = _start_bench(stub_engines, out, ignore_sigint=background)
    try:
        wait_healthy(f"http://127.0.0.1:{stub_engines[2]}", bench)
        time.sleep(2.0)  # a turn in flight
        interrupted = time.monotonic()
        if to_group:  # Ctrl-C in a terminal: the whole foreground job
            os.killpg(bench.pid, signum)
        else:
            bench.send_signal(signum)
        code = bench.wait(timeout=60)
        stopped_after_s = time.monotonic() - interrupted
        stderr = bench.stderr.read() if bench.stderr else ""
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    assert stopped_after_s < STOPPED_WITHIN_S, f"ran on for {stopped_after_s:.0f} s: {stderr}"
    assert code == 130, stderr
    assert "interrupted" in stderr
    assert "Traceback" not in stderr
    assert not (out / JSON_NAME).exists()  # a cut-short run is not reported as a result


def _turns_served(url: str) -> int | None:
    """The router's ``agentkv_turns_total``, summed over paths; None while none listens."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=1).text
    except httpx.HTTPError:
        return None
    lines = (line for line in text.splitlines() if line.startswith("agentkv_turns_total{"))
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines)


def _wait_measuring(url: str, process: subprocess.Popen[str]) -> None:
    """Until the measured run's router has served a turn: the warm-up has its own router,
    whose count the measured one starts again from zero."""
    most = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        served = _turns_served(url)
        if served is not None and 0 < served < most:
            return
        most = max(most, served or 0)
        time.sleep(0.05)
    raise AssertionError("bench never reached its measured turns")


def test_a_run_in_the_background_ignores_sigint_as_its_shell_asked(
    stub_engines: tuple[str, str, int], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    bench = _start_bench(stub_engines, out, "--modes", "recompute", ignore_sigint=True)
    try:
        _wait_measuring(f"http://127.0.0.1:{stub_engines[2]}", bench)
        os.killpg(bench.pid, signal.SIGINT)
        code = bench.wait(timeout=120)
        stderr = bench.stderr.read() if bench.stderr else ""
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    assert code == 0, stderr  # every turn answered: no router stopped under the run
    result = json.loads((out / JSON_NAME).read_text())
    assert [r["error"] for r in result["records"]] == [None] * 8
