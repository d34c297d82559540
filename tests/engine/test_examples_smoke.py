"""The runnable examples against the real stack (router + vLLM P/D) and the real default model.

Checks what every example promises: it finishes, prints one line per model call with the
router's KV path, every turn after the first follows tool results, every tool call it printed
had arguments its tool accepted (the bounded schemas guarantee it when a call parses), and
follow-up turns reuse the decode engine's KV. What the frameworks put on the wire is checked over
loopback in tests/unit/integrations.
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
TOOL_LINE = re.compile(r"^  tool (\w+)\((.*)\) -> (.*)$")

pytestmark = pytest.mark.engine


def run_example(stack: Stack, example: str, turns: int) -> tuple[list[re.Match[str]], list[str]]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example)],
        check=False,
        env={**os.environ, **stack.client_environment(), "AGENTKV_TURNS": str(turns)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    tool_results = [m.group(3) for line in lines if (m := TOOL_LINE.match(line))]
    return [m for line in lines if (m := TURN_LINE.match(line))], tool_results


@pytest.mark.parametrize(
    ("example", "model_calls"),
    [
        ("tool_loop.py", 4),
        ("langchain_agent.py", 4),
        ("llamaindex_agent.py", 4),
        # The Agents SDK run ends after its last tool turn: one model call fewer.
        ("openai_agents_agent.py", 3),
    ],
)
def test_example_runs_a_tool_loop_that_reuses_kv(
    real_stack: Stack, example: str, model_calls: int
) -> None:
    lines, tool_results = run_example(real_stack, example, turns=4)
    assert [int(m.group(1)) for m in lines] == list(range(1, model_calls + 1))
    assert lines[0].group(2) in {"recompute", "fallback"}
    assert any(m.group(2) == "reuse" for m in lines[1:])
    assert all("after tool results" in m.string for m in lines[1:])
    assert len(tool_results) == 3
    assert not [result for result in tool_results if "error" in result]
