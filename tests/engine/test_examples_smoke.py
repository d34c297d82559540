"""The runnable examples against the real stack (router + vLLM P/D, random-weight model).

The model's words are noise, so this checks what the plain SDK loop promises on any model: it
finishes, prints one line per model call with the router's KV path, flags tool-result turns, and
its follow-up turns reuse the decode engine's KV. The framework examples are covered over loopback
in tests/unit/integrations (their agents stop when a random-weight model returns no valid call).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv_server.bundle.stack import Stack

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TURN_LINE = re.compile(r"^turn +(\d+)  ttft +[\d.]+ s  kv (reuse|recompute|fallback)")

pytestmark = pytest.mark.engine


def run_example(stack: Stack, example: str, turns: int) -> list[re.Match[str]]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example)],
        check=False,
        env={
            **os.environ,
            "AGENTKV_BASE_URL": f"{stack.endpoint}/v1",
            "AGENTKV_MODEL": stack.served_name,
            "AGENTKV_TURNS": str(turns),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [m for line in done.stdout.splitlines() if (m := TURN_LINE.match(line))]


def test_tool_loop_reuses_kv_on_follow_up_turns(stack: Stack) -> None:
    lines = run_example(stack, "tool_loop.py", turns=4)
    assert [int(m.group(1)) for m in lines] == [1, 2, 3, 4]
    assert lines[0].group(2) in {"recompute", "fallback"}
    assert any(m.group(2) == "reuse" for m in lines[1:])
    assert all("after tool results" in m.string for m in lines[1:])
