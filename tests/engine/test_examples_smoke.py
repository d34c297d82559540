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
from collections.abc import Iterator
from dataclasses import dataclass
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


EXAMPLE_NAMES = [
    "tool_loop.py",
    "langchain_agent.py",
    "llamaindex_agent.py",
    "openai_agents_agent.py",
]
TURNS = 4


@dataclass
class ExampleRun:
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def output(self) -> tuple[list[re.Match[str]], list[str], list[str]]:
        """The example's turn lines, its tool results, and its output lines."""
        returncode = self.process.wait(timeout=600)
        stdout, stderr = self.stdout.read_text(), self.stderr.read_text()
        assert returncode == 0, stdout + stderr
        lines = stdout.splitlines()
        tool_results = [m.group(3) for line in lines if (m := TOOL_LINE.match(line))]
        return [m for line in lines if (m := TURN_LINE.match(line))], tool_results, lines


@pytest.fixture(scope="module")
def example_runs(
    real_stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ExampleRun]]:
    """Every example started at once, as four users of one stack would: the engines batch
    their steps, so together they take little longer than the slowest alone."""
    env = {**os.environ, **real_stack.client_environment(), "AGENTKV_TURNS": str(TURNS)}
    out = tmp_path_factory.mktemp("examples")
    runs: dict[str, ExampleRun] = {}
    try:
        for example in EXAMPLE_NAMES:
            stdout, stderr = out / f"{example}.out", out / f"{example}.err"
            with stdout.open("wb") as out_file, stderr.open("wb") as err_file:
                process = subprocess.Popen(
                    [sys.executable, str(EXAMPLES / example)],
                    env=env,
                    stdout=out_file,
                    stderr=err_file,
                )
            runs[example] = ExampleRun(process, stdout, stderr)
        yield runs
    finally:
        for run in runs.values():
            run.process.kill()
            run.process.wait()


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_example_runs_a_tool_loop_that_reuses_kv(
    example_runs: dict[str, ExampleRun], example: str
) -> None:
    lines, tool_results, output = example_runs[example].output()
    assert [int(m.group(1)) for m in lines] == list(range(1, TURNS + 1))
    assert lines[0].group(2) in {"recompute", "fallback"}
    assert any(m.group(2) == "reuse" for m in lines[1:])
    assert all("after tool results" in m.string for m in lines[1:])
    assert tool_results == RIGHT_RESULTS, "\n".join(output)
    assert RIGHT_ANSWER in output, "\n".join(output)
