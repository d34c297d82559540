"""The ``agents12`` preset's figures per mode: turns sent, failed turns, follow-up TTFT p50/p99,
the follow-ups' reuse share, end-to-end turn times and engines marked down, then the same per
kind of session; written as ``results.json`` and ``summary.md``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from agentkv_server.bench.agents12 import KINDS
from agentkv_server.bench.records import SweepResult
from agentkv_server.bench.report import JSON_NAME, MARKDOWN_NAME, header_lines
from agentkv_server.bench.turn_figures import TurnFigures

__all__ = [
    "MEASURES",
    "AgentsRow",
    "is_agents",
    "render_agents_markdown",
    "summarize_agents",
    "write_agents_report",
]

MEASURES: Final = "agents12"  # config["measures"] of the agents12 preset's results.json


def is_agents(data: Mapping[str, Any]) -> bool:
    """Whether a results.json holds an agents12 run."""
    return data.get("config", {}).get("measures") == MEASURES


@dataclass(frozen=True)
class AgentsRow:
    """One mode's turns, repeats pooled: all sessions (``kind`` None) or one kind's."""

    mode: str
    kind: str | None
    runs: int
    figures: TurnFigures
    marked_down: float | None
    """The router's ``agentkv_engines_marked_down_total`` over the runs (None: not counted)."""


def summarize_agents(result: SweepResult) -> list[AgentsRow]:
    """Per mode, a row of all sessions, then one per kind."""
    rows = []
    for mode in dict.fromkeys(w.mode for w in result.windows):
        turns = [t for t in result.turns if t.turn.mode == mode]
        windows = [w for w in result.windows if w.mode == mode]
        counted = [w.marked_down for w in windows]
        down = None if None in counted else sum(c for c in counted if c is not None)
        for kind in (None, *KINDS):
            mine = [t for t in turns if kind is None or t.label == kind]
            rows.append(AgentsRow(mode, kind, len(windows), TurnFigures.of(mine), down))
    return rows


def write_agents_report(result: SweepResult, out_dir: Path) -> list[Path]:
    """``results.json`` (with the rows) and ``summary.md`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize_agents(result)
    data = result.to_dict()
    data["config"] = {**data["config"], "measures": MEASURES}
    data["rows"] = [{**asdict(r), "reuse_share": r.figures.reuse_share} for r in rows]
    (out_dir / JSON_NAME).write_text(json.dumps(data, indent=1))
    (out_dir / MARKDOWN_NAME).write_text(render_agents_markdown(result, rows))
    return [out_dir / JSON_NAME, out_dir / MARKDOWN_NAME]


def render_agents_markdown(result: SweepResult, rows: Sequence[AgentsRow]) -> str:
    config = result.config
    lines = [
        *header_lines("agentkv bench: issue 48's twelve agent sessions", config),
        "",
        (
            "Failed: turns accepted and never answered, after the client's retries; refused: "
            "turns refused at arrival on every try (a session stops at either); retried: turns "
            "that took more than one try. Follow-up TTFT: served "
            "follow-ups (turn >= 2), from the first try. Reused: follow-ups whose KV path was "
            "`local` or `reuse` (`x-agentkv-kv-path`; without a router, prefix-cache hits). "
            "End-to-end: every served turn, first try to the stream's end. Marked down: the "
            "router's `agentkv_engines_marked_down_total` over the runs (n/a: not counted). "
            "Percentiles are nearest-rank, repeats pooled."
        ),
        "",
        (
            "| mode | sessions | turns | failed | refused | retried | follow-up TTFT p50 / p99 (s) "
            "| reused | end-to-end p50 / p99 / max (s) | engines marked down |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_row_line(r) for r in rows),
    ]
    return "\n".join(lines) + "\n"


def _row_line(r: AgentsRow) -> str:
    f = r.figures
    cells = [
        r.mode,
        r.kind or "all",
        str(f.turns),
        str(f.failed),
        str(f.refused),
        str(f.retried),
        f"{_seconds(f.followup_p50_s)} / {_seconds(f.followup_p99_s)}",
        "n/a" if f.reuse_share is None else f"{f.reuse_share:.0%} ({f.reused}/{f.followups})",
        " / ".join(_seconds(v) for v in (f.e2e_p50_s, f.e2e_p99_s, f.e2e_max_s)),
        _marked_down(r),
    ]
    return "| " + " | ".join(cells) + " |"


def _marked_down(r: AgentsRow) -> str:
    if r.kind is not None:
        return "-"  # the router counts engines, not sessions
    return "n/a" if r.marked_down is None else f"{r.marked_down:g}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
