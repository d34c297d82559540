"""The model against the seed: AWS's published 1P1D H200 recompute -> pull TTFTs, reproduced as
ratios from the catalog's inputs (nothing fitted to them)."""

from __future__ import annotations

import pytest

from agentkv_server.plan import SEED_CASES, SEED_TOLERANCE, check_seed


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: c.serving.model.name)
def test_model_reproduces_the_published_ratio(case) -> None:
    check = check_seed(case)
    assert abs(check.predicted_ratio / check.published_ratio - 1) <= SEED_TOLERANCE, (
        f"{case.label}: predicted {check.predicted_ratio:.2f}x, "
        f"published {check.published_ratio:.2f}x"
    )


def test_seed_cases_are_the_published_figures() -> None:
    ratios = sorted(round(c.published_ratio, 2) for c in SEED_CASES)
    assert ratios == [round(0.778 / 0.460, 2), round(2.334 / 0.702, 2)]


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: c.serving.model.name)
def test_pull_beats_recompute_at_the_seed_history_as_published(case) -> None:
    check = check_seed(case)
    assert check.predicted_pull_s < check.predicted_recompute_s
    assert check.predicted_ratio > 1.3
