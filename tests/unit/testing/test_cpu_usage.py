"""Process-group reading from /proc: which members still live."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from agentkv_server.testing.cpu_usage import live_group_members


def test_live_group_members_leaves_out_zombies() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        assert live_group_members(child.pid) == [child.pid]
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while live_group_members(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live_group_members(child.pid) == []
        os.killpg(child.pid, 0)  # not reaped yet: killpg still finds the zombie
    finally:
        child.kill()
        child.wait()
