"""The examples run end to end against a loopback OpenAI-compatible server (no engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize(
    "example",
    ["tool_loop.py", "langchain_agent.py", "llamaindex_agent.py", "openai_agents_agent.py"],
)
def test_example_prints_each_turn_of_one_tagged_tool_loop(
    example: str, server, loopback_url: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example)],
        check=False,
        env={**os.environ, "AGENTKV_BASE_URL": loopback_url, "AGENTKV_TURNS": "4"},
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert done.returncode == 0, done.stderr
    session_id = server.check_tool_loop(server.requests)
    turn_lines = [line for line in done.stdout.splitlines() if line.startswith("turn ")]
    assert len(turn_lines) == len(server.requests)
    assert "kv recompute" in turn_lines[0]
    assert all("kv reuse (96 tokens reused)" in line for line in turn_lines[1:])
    assert f"session {session_id}: {len(server.requests)} turns, KV reused on" in done.stdout
