"""Repository contracts that users and CI rely on: README's two commands and .ci/run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_command(marker: str) -> str:
    """The fenced block right after ``<!-- agentkv:MARKER -->`` in README.md."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- agentkv:{marker} -->\n```(?:bash|sh)?\n(.*?)\n```", text, re.DOTALL)
    assert match, f"README.md lacks a fenced block right after <!-- agentkv:{marker} -->"
    return match.group(1).strip()


def test_readme_has_exactly_two_marked_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(re.findall(r"<!-- agentkv:(run|test) -->", text)) == 2
    for marker in ("run", "test"):
        assert ".venv" in readme_command(marker) or "scripts/install" in readme_command(marker)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_command("test") in ci.splitlines()


def test_install_script_creates_the_venv_at_repo_root() -> None:
    script = (ROOT / "scripts" / "install").read_text()
    assert "python3 -m venv .venv" in script
