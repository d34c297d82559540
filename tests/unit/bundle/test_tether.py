"""A server started ``dies_with_launcher`` goes, with everything it forked, when its launcher is
SIGKILLed (agentkv_server.bundle.tether). Stand-in servers here; tests/engine/test_orphans.py
does the same to a real vLLM engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.process import ManagedProcess
from agentkv_server.bundle.tether import GRACE_S, wait_for_exit
from agentkv_server.testing.cpu_usage import live_group_members

# A module (tethered commands are `python -m MODULE`) that serves /health on the port in
# argv[1] after starting a grandchild; with argv[2] == "stubborn" both ignore SIGTERM (the
# child inherits SIG_IGN).
STAND_IN = """
import http.server, signal, subprocess, sys
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

# Starts the stand-in from a thread that then ends, as a Stack started with asyncio.to_thread
# does (the case that defeats PR_SET_PDEATHSIG), prints its pid once healthy, and waits.
LAUNCHER = """
import sys, threading, time
from pathlib import Path
from agentkv_server.bundle.process import ManagedProcess
port, mode, log = sys.argv[1], sys.argv[2], Path(sys.argv[3])
server = ManagedProcess(
    "stand-in", [sys.executable, "-m", "stand_in", port, mode],
    health_url=f"http://127.0.0.1:{port}/health", log_path=log, dies_with_launcher=True,
)
starter = threading.Thread(target=server.start)
starter.start()
starter.join()
server.wait_healthy(timeout=30)
print(server.pid, flush=True)
time.sleep(600)
"""


@contextmanager
def launched_stand_in(tmp_path: Path, mode: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A launcher process and its stand-in server's process group; no member outlives it."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    port = free_ports(1)[0]
    log = tmp_path / "stand-in.log"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(port), mode, str(log)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    pgid = 0
    try:
        assert launcher.stdout is not None
        pgid = int(launcher.stdout.readline())
        assert len(live_group_members(pgid)) == 2  # the server and its child
        yield launcher, pgid
    finally:
        launcher.kill()
        launcher.wait()
        if pgid and live_group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)


def seconds_until_gone(pgid: int, limit: float) -> float:
    began = time.monotonic()
    while live_group_members(pgid) and time.monotonic() - began < limit:
        time.sleep(0.05)
    assert not live_group_members(pgid), f"group {pgid} outlived its launcher by {limit:.0f} s"
    return time.monotonic() - began


def test_a_server_and_its_children_go_when_the_launcher_is_killed(tmp_path: Path) -> None:
    with launched_stand_in(tmp_path, "plain") as (launcher, pgid):
        launcher.kill()
        gone = seconds_until_gone(pgid, limit=10)
    print(f"\nstand-in group gone {gone:.2f} s after its launcher's SIGKILL")
    assert f"launcher {launcher.pid} is gone" in (tmp_path / "stand-in.log").read_text()


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    with launched_stand_in(tmp_path, "stubborn") as (launcher, pgid):
        launcher.kill()
        gone = seconds_until_gone(pgid, limit=GRACE_S + 10)
    print(f"\nstubborn stand-in group gone {gone:.2f} s after its launcher's SIGKILL")
    assert gone >= GRACE_S - 1  # SIGTERM did nothing; SIGKILL came after the grace


def test_a_launcher_gone_before_the_watch_began_is_noticed_at_once() -> None:
    not_our_parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        began = time.monotonic()
        wait_for_exit(not_our_parent.pid)  # as after the launcher died and we were reparented
        assert time.monotonic() - began < 1
    finally:
        not_our_parent.kill()
        not_our_parent.wait()


def test_only_python_module_commands_can_die_with_their_launcher(tmp_path: Path) -> None:
    process = ManagedProcess(
        "script",
        [sys.executable, "-c", "pass"],
        health_url="http://127.0.0.1:1/health",
        log_path=tmp_path / "script.log",
        dies_with_launcher=True,
    )
    with pytest.raises(ValueError, match="python -m MODULE"):
        process.start()
