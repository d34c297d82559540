"""A stack whose launcher is SIGKILLed goes with it: the engine's whole process tree (API server,
EngineCore, worker) and the router are gone within seconds, not left running as orphans that
hold ~3 GB and their ports (agentkv_server.bundle.tether, docs/faults.md).

One 1-decode stack (tiny model) is started in a launcher process from a thread that then ends,
as ``asyncio.to_thread`` callers do. ``pytest -s`` prints the seconds until each group is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentkv_server.bundle.tether import GRACE_S
from agentkv_server.testing.cpu_usage import live_group_members

pytestmark = pytest.mark.engine

START_TIMEOUT_S = 600
# SIGTERM, vLLM's shutdown (a few seconds), SIGKILL after the tether's grace at the latest.
GONE_WITHIN_S = GRACE_S + 10

LAUNCHER = """
import json, sys, threading, time
from pathlib import Path
from agentkv_server.bundle.stack import Stack, StackConfig
config = StackConfig(model="tiny", prefill=0, decode=1, port=0, log_dir=Path(sys.argv[1]))
stack = Stack(config)
starter = threading.Thread(target=stack.start, args=(float(sys.argv[2]),))
starter.start()
starter.join()
print(json.dumps({p.name: p.pid for p in [*stack.engines, stack.router]}), flush=True)
time.sleep(3600)
"""


def test_engines_and_router_go_when_the_launcher_is_killed(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(START_TIMEOUT_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
    groups: dict[str, int] = {}
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert line, f"the stack did not start; logs in {tmp_path}"
        groups = json.loads(line)
        trees = {name: live_group_members(pgid) for name, pgid in groups.items()}
        engine = next(name for name in groups if name.startswith("decode"))
        assert len(trees[engine]) >= 2, trees  # the API server and the EngineCore at least

        launcher.kill()
        killed = time.monotonic()
        gone: dict[str, float] = {}
        while len(gone) < len(groups) and time.monotonic() - killed < GONE_WITHIN_S:
            for name, pgid in groups.items():
                if name not in gone and not live_group_members(pgid):
                    gone[name] = time.monotonic() - killed
            time.sleep(0.1)

        print(f"\nafter the launcher's SIGKILL, gone in: {gone}; process trees were {trees}")
        left = {name: live_group_members(pgid) for name, pgid in groups.items()}
        assert not any(left.values()), f"still running {GONE_WITHIN_S:.0f} s later: {left}"
        assert f"launcher {launcher.pid} is gone" in (tmp_path / "decode-0.log").read_text()
    finally:
        launcher.kill()
        launcher.wait()
        for pgid in groups.values():  # whatever this test failed on, leave no engine behind
            if live_group_members(pgid):
                os.killpg(pgid, signal.SIGKILL)
