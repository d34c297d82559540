"""One turn's KV path: one value, named on the wire as docs/protocol.md section 3 says."""

from __future__ import annotations

import re
from pathlib import Path

from agentkv import protocol
from agentkv_server.router import KVPath, TurnHints
from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.turn import Turn

DOCS = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def _turn() -> Turn:
    request = ClientRequest("chat", {}, "m", False, "s-1", TurnHints(), {})
    return Turn(request, started=0.0)


def test_paths_are_the_documented_header_values() -> None:
    (row,) = [
        line for line in DOCS.read_text().splitlines() if f"`{protocol.HEADER_KV_PATH}`" in line
    ]
    documented = set(re.findall(r"`(local|reuse|recompute|fallback|pull)`", row))
    assert {path.value for path in KVPath} == documented


def test_a_turn_starts_recomputing_and_falls_back_once_a_plan_fails() -> None:
    turn = _turn()
    assert turn.path is KVPath.RECOMPUTE and not turn.pulls and not turn.local
    turn.path = KVPath.PULL
    assert turn.pulls and turn.headers()[protocol.HEADER_KV_PATH] == "reuse"
    turn.fall_back()
    assert not turn.pulls and turn.headers()[protocol.HEADER_KV_PATH] == "fallback"
    assert turn.headers()[protocol.HEADER_RESPONSE_SESSION_ID] == "s-1"
