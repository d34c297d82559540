"""ManagedProcess on small stand-in servers: health waits, clear failures, no orphans."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.process import ManagedProcess, log_tail
from agentkv_server.errors import EngineError, PortInUseError
from agentkv_server.testing.conditions import wait_until

# Serves /health on the port in argv[1], after starting a grandchild that would outlive it.
SERVER = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def server(
    tmp_path: Path, script: str = SERVER, fatal_markers: tuple[str, ...] = ()
) -> ManagedProcess:
    port = free_ports(1)[0]
    return ManagedProcess(
        "stand-in",
        [sys.executable, "-c", script, str(port)],
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=tmp_path / "logs" / "stand-in.log",
        fatal_markers=fatal_markers,
    )


# Logs a fatal line, then lingers without serving, as an engine whose core died does.
LINGERS_AFTER = """
import sys, time
print("starting", flush=True)
time.sleep(0.5)
print(sys.argv[2], flush=True)
time.sleep(60)
"""


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_waits_until_healthy_and_stop_ends_the_whole_group(tmp_path: Path) -> None:
    process = server(tmp_path)
    process.start()
    process.wait_healthy(timeout=30)
    pgid = process.pid
    assert pgid is not None and group_alive(pgid)
    process.stop(timeout=5)
    assert not process.is_running()
    deadline = time.monotonic() + 5
    while group_alive(pgid) and time.monotonic() < deadline:  # the kernel reaps the grandchild
        time.sleep(0.05)
    assert not group_alive(pgid), "a child of the stopped process survived"
    assert "serving" in process.log_tail()


def test_kill_ends_the_whole_group(tmp_path: Path) -> None:
    process = server(tmp_path)
    process.start()
    process.wait_healthy(timeout=30)
    process.kill()
    assert not process.is_running()


def test_a_process_that_exits_during_start_up_fails_with_its_log_tail(tmp_path: Path) -> None:
    process = server(tmp_path, "import sys; print('no model here'); sys.exit(3)")
    process.start()
    with pytest.raises(EngineError, match="exited during start-up") as failure:
        process.wait_healthy(timeout=30)
    assert "no model here" in str(failure.value)
    assert str(process.log_path) in str(failure.value)


def test_a_process_that_never_gets_healthy_times_out_and_says_so(tmp_path: Path) -> None:
    process = server(tmp_path, "import time; print('loading', flush=True); time.sleep(60)")
    process.start()
    try:
        # Its first line first (a loaded machine can take over a second to start Python), so
        # that the timeout's message has a log tail to carry.
        wait_until(lambda: "loading" in process.log_tail(), "started")
        with pytest.raises(EngineError, match="not healthy after 1 s") as failure:
            process.wait_healthy(timeout=1)
        assert "loading" in str(failure.value)
    finally:
        process.stop(timeout=5)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("OSError: [Errno 98] Address already in use", PortInUseError),
        ("RuntimeError: Engine core initialization failed. See root cause above.", EngineError),
    ],
)
def test_a_fatal_log_line_fails_the_start_at_once_although_the_process_lingers(
    tmp_path: Path, line: str, error: type[EngineError]
) -> None:
    process = server(tmp_path, LINGERS_AFTER, fatal_markers=("Engine core initialization failed",))
    process.command.append(line)
    process.start()
    started = time.monotonic()
    try:
        with pytest.raises(error, match="during start-up") as failure:
            process.wait_healthy(timeout=60)
    finally:
        process.stop(timeout=5)
    assert time.monotonic() - started < 10, "the fatal line was noticed late"
    assert line in str(failure.value)
    assert failure.type is error


def test_a_process_that_exits_after_a_port_clash_raises_port_in_use(tmp_path: Path) -> None:
    script = "print('OSError: [Errno 98] Address already in use', flush=True); raise SystemExit(1)"
    process = server(tmp_path, script)
    process.start()
    with pytest.raises(PortInUseError, match="exited during start-up"):
        process.wait_healthy(timeout=30)


def test_starting_twice_is_an_error(tmp_path: Path) -> None:
    process = server(tmp_path)
    process.start()
    try:
        with pytest.raises(EngineError, match="already started"):
            process.start()
    finally:
        process.stop(timeout=5)


def test_stop_before_start_does_nothing(tmp_path: Path) -> None:
    server(tmp_path).stop()


def test_log_tail_keeps_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    assert log_tail(log) == ""
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 3) == "line 97\nline 98\nline 99"


def test_stopping_twice_signals_nothing_the_second_time(tmp_path: Path, monkeypatch) -> None:
    process = server(tmp_path)
    process.start()
    process.wait_healthy(timeout=30)
    process.kill()
    monkeypatch.setattr(os, "killpg", pytest.fail)  # the group id may belong to others now
    process.stop()
    process.kill()
