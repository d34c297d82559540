"""The rooms import one way, and only the wire module spells a router <-> engine name.

Parsed, not imported: imports inside functions count, and nothing here needs vLLM.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agentkv_server import wire

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server" / "agentkv_server"

# Room -> rooms of agentkv_server it must never import.
FORBIDDEN = {
    "router": ("testing", "bench", "bundle", "connector", "plan"),
    "connector": ("router", "testing", "bench", "bundle", "plan"),
    "bundle": ("testing", "bench", "plan"),
}
# Too plain a word to count as a spelling of the protocol.
_PLAIN = {wire.REPORT_TICKET, wire.KV_LOAD_OK, wire.KV_LOAD_FAILED}
WIRE_NAMES = {
    value
    for name in wire.__all__
    if isinstance(value := getattr(wire, name), str) and value not in _PLAIN
}


def _imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_import_one_way(room: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((SERVER / room).rglob("*.py"))
        for name in sorted(_imported(ast.parse(path.read_text())))
        if any(name.startswith(f"agentkv_server.{other}") for other in FORBIDDEN[room])
    ]
    assert wrong == []


def _spelled(tree: ast.AST) -> set[str]:
    """String constants in code (docstrings and comments excluded)."""
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    }


def test_only_the_wire_module_spells_engine_names() -> None:
    files = [*SERVER.rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    spelled = [
        f"{path.relative_to(ROOT)}: {name!r}"
        for path in sorted(files)
        if path != SERVER / "wire.py"
        for name in sorted(_spelled(ast.parse(path.read_text())) & WIRE_NAMES)
    ]
    assert spelled == []
