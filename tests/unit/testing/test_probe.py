"""The oracle's comparison of two top-k logprob maps."""

from __future__ import annotations

import math

import pytest

from agentkv_server.testing.probe import LOGPROB_TOLERANCE, logprob_gap

WANT = {"token_id:1": -1.0, "token_id:2": -2.0, "token_id:3": -5.0}


def test_identical_maps_have_no_gap() -> None:
    assert logprob_gap(dict(WANT), WANT) == 0


def test_gap_is_the_largest_difference_over_the_same_tokens() -> None:
    assert logprob_gap({**WANT, "token_id:1": -1.25}, WANT) == 0.25


def test_a_shifted_common_token_fails_the_oracle() -> None:
    """Wrong KV moved common tokens by >0.05 (docs/engines.md)."""
    assert logprob_gap({**WANT, "token_id:2": -2.06}, WANT) > LOGPROB_TOLERANCE


def test_a_swap_at_the_cut_within_tolerance_passes() -> None:
    """Tokens 3 and 4 sit 2e-5 apart at the cut; the other computation ranks 4 above 3."""
    got = {"token_id:1": -1.0, "token_id:2": -2.0, "token_id:4": -4.99998}
    assert logprob_gap(got, WANT) == pytest.approx(2e-5)
    assert logprob_gap(got, WANT) < LOGPROB_TOLERANCE
    assert logprob_gap(WANT, got) < LOGPROB_TOLERANCE


def test_a_swap_at_the_cut_beyond_tolerance_fails() -> None:
    got = {"token_id:1": -1.0, "token_id:2": -2.0, "token_id:4": -4.9}
    assert logprob_gap(got, WANT) == pytest.approx(0.1)
    assert logprob_gap(WANT, got) == pytest.approx(0.1)


def test_a_token_that_vanished_from_far_above_the_cut_fails() -> None:
    """Token 2 left ``got``'s top-k although ``want`` puts it 3 nats above the cut."""
    got = {"token_id:1": -1.0, "token_id:3": -5.0, "token_id:4": -5.0}
    assert logprob_gap(got, WANT) == pytest.approx(3.0)


def test_a_disjoint_top_k_fails() -> None:
    got = {"token_id:7": -0.5, "token_id:8": -1.5, "token_id:9": -3.0}
    assert logprob_gap(got, WANT) == pytest.approx(4.5)


def test_an_empty_map_against_a_full_one_is_an_infinite_gap() -> None:
    assert math.isinf(logprob_gap({}, WANT))
    assert logprob_gap({}, {}) == 0


def test_tolerance_sits_between_fp32_noise_and_wrong_kv() -> None:
    """docs/engines.md: fp32 reordering moved logprobs by <5e-7, a wrong prefix by >0.05."""
    assert 5e-7 * 100 < LOGPROB_TOLERANCE < 0.05 / 100
