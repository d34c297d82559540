"""The plan as JSON, table and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv_server.plan import SEED_CASES, SERVINGS, ClusterModel, build_plan
from agentkv_server.plan.report import MODEL_LABEL, plan_json, render_table, write_plot


@pytest.fixture(scope="module")
def plan():
    models = [ClusterModel(SERVINGS[key]) for key in sorted(SERVINGS)]
    return build_plan(models, [2048, 32768], 2)


def test_json_carries_the_label_the_seed_check_and_every_row(plan) -> None:
    data = json.loads(json.dumps(plan_json(plan)))
    assert data["label"] == MODEL_LABEL and "not a measurement" in data["label"].lower()
    assert len(data["seed_check"]) == len(SEED_CASES)
    for entry, case in zip(data["seed_check"], SEED_CASES):
        assert entry["published_ratio"] == round(case.published_ratio, 3)
        assert entry["predicted_ratio"] == pytest.approx(
            entry["predicted_ms"]["recompute"] / entry["predicted_ms"]["pull"], rel=1e-2
        )
        assert entry["within_tolerance"] == (abs(entry["relative_error"]) <= 0.15)
    assert [m["name"] for m in data["models"]] == [m.serving.model.name for m in plan.models]
    for model in data["models"]:
        assert {"gpu", "node", "link", "model_config", "serving", "workload", "slo"} <= set(
            model["inputs"]
        )
        assert model["inputs"]["link"]["efficiency"]["source"]["kind"] == "measurement"
        assert model["derived"]["kv_bytes_per_token"] > 0
        for row in model["rows"]:
            assert set(row["ttft_ms"]) == {"recompute", "pull", "holder"}
            assert row["policy_margin"][row["best"]] == 1.0


def test_every_input_names_its_source(plan) -> None:
    def sources(node):
        if isinstance(node, list):
            for child in node:
                yield from sources(child)
        elif isinstance(node, dict):
            if "source" in node and "value" in node:
                yield node["source"]
            for child in node.values():
                yield from sources(child)

    found = list(sources(plan_json(plan)["models"]))
    assert len(found) > 15
    assert all(s["kind"] in {"specification", "configuration", "measurement", "assumption"}
               and s["reference"] for s in found)  # fmt: skip


def test_table_has_the_label_the_seed_lines_and_one_line_per_row(plan) -> None:
    table = render_table(plan)
    assert table.startswith(MODEL_LABEL)
    assert table.count("seed check,") == len(SEED_CASES)
    rows = sum(len(r) for r in plan.rows.values())
    assert sum(1 for line in table.splitlines() if line.strip().endswith("x")) == rows


def test_plot_is_a_png(plan, tmp_path: Path) -> None:
    path = write_plot(plan, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
