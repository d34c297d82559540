"""docs/cluster-model.md states what the model computes today (rerun `agentkv plan` and paste
when an input changes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentkv_server.plan import SEED_CASES, SERVINGS, ClusterModel, build_plan, check_seed
from agentkv_server.plan.cli import DEFAULT_HISTORIES
from agentkv_server.plan.report import render_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "cluster-model.md"


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: c.serving.model.name)
def test_doc_quotes_the_seed_check_as_computed(case) -> None:
    check = check_seed(case)
    row = next(
        line
        for line in DOC.read_text().splitlines()
        if line.startswith(f"| {case.serving.model.name}, ")
    )
    assert f"{check.predicted_ratio:.2f}x" in row
    assert f"{check.relative_error:+.0%}" in row


def test_doc_table_is_the_commands_output() -> None:
    models = [ClusterModel(SERVINGS[key]) for key in sorted(SERVINGS)]
    table = render_table(build_plan(models, DEFAULT_HISTORIES, 3))
    rows = table.split("\n\n", 2)[2]
    assert rows.strip() in DOC.read_text()
    assert (DOC.parent / "cluster-model.png").stat().st_size > 0
