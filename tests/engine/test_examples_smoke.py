"""The runnable examples against the real stack (router + vLLM P/D) and the real default model.

Checks what every example promises: it finishes, prints one line per model call with the
router's KV path, every turn after the first follows tool results, every tool call it printed
had arguments its tool accepted (the bounded schemas guarantee it when a call parses), follow-up
turns reuse the decode engine's KV, and the model got the task right: the tools answered what the
right arguments give and the answer holds the capital and the total (greedy decoding). What the frameworks put on the wire is checked over
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
# examples/_common.py's TASK: trip.txt names Japan, the user adds 120 and 45.
RIGHT_RESULTS = ["'Trip to Japan in May.'", "'Tokyo'", "'165'"]
RIGHT_ANSWER = "answer: the capital of Japan is Tokyo, the total is 165"

pytestmark = pytest.mark.engine


def run_example(
    stack: Stack, example: str, turns: int
) -> tuple[list[re.Match[str]], list[str], list[str]]:
    """The example's turn lines, its tool results, and its output lines."""
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
    return [m for line in lines if (m := TURN_LINE.match(line))], tool_results, lines


@pytest.mark.parametrize(
    "example",
    ["tool_loop.py", "langchain_agent.py", "llamaindex_agent.py", "openai_agents_agent.py"],
)
def test_example_runs_a_tool_loop_that_reuses_kv(real_stack: Stack, example: str) -> None:
    lines, tool_results, output = run_example(real_stack, example, turns=4)
    assert [int(m.group(1)) for m in lines] == [1, 2, 3, 4]
    assert lines[0].group(2) in {"recompute", "fallback"}
    assert any(m.group(2) == "reuse" for m in lines[1:])
    assert all("after tool results" in m.string for m in lines[1:])
    assert tool_results == RIGHT_RESULTS, "\n".join(output)
    assert RIGHT_ANSWER in output, "\n".join(output)
