"""`agentkv serve` started again and again on the same router port: every start becomes ready.

Reproduces two start failures seen on these machines (docs/faults.md): engines handed ports
from the kernel's ephemeral range, where an engine's own UCX listener could take its NIXL side
channel's port first (1 start in 5 hung until the start timeout), and a restart within a
minute of a stop refused because the router's port still had connections in TIME-WAIT.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentkv_server.bundle.ports import free_ports

pytestmark = pytest.mark.engine

STARTS = 5
# Run once the stack is ready: one chat turn through the router, then stop. Plain urllib: the
# openai package takes seconds to import here, five times over.
ONE_TURN = (
    'python -c "import json, os, urllib.request as u; '
    "body = {'model': os.environ['AGENTKV_MODEL'], 'max_tokens': 2, "
    "'messages': [{'role': 'user', 'content': 'hi'}]}; "
    "r = u.urlopen(u.Request(os.environ['AGENTKV_BASE_URL'] + '/chat/completions', "
    "json.dumps(body).encode(), {'Content-Type': 'application/json'}), timeout=60); "
    "print('answered', json.load(r)['choices'][0]['finish_reason'])\""
)


SERVE = [sys.executable, "-m", "agentkv_server.cli", "serve", "--model", "tiny"]
SERVE += ["--start-timeout", "240", "--run", ONE_TURN]


@pytest.mark.timeout(STARTS * 300)
def test_consecutive_serve_starts_on_one_port_each_become_ready(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    seconds = []
    for start in range(STARTS):
        began = time.monotonic()
        done = subprocess.run(
            [*SERVE, "--port", str(port), "--log-dir", str(tmp_path / f"start-{start}")],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        seconds.append(round(time.monotonic() - began, 1))
        assert done.returncode == 0, f"start {start + 1}:\n{done.stdout}\n{done.stderr}"
        assert "ready at" in done.stdout and "answered" in done.stdout
    print(f"\n{STARTS} `agentkv serve --run` cycles on port {port}, seconds each: {seconds}")
