"""The oracle's comparison of two top-k logprob maps."""

from __future__ import annotations

import math

from agentkv_server.testing.probe import LOGPROB_TOLERANCE, logprob_gap


def test_gap_is_the_largest_difference_over_the_same_tokens() -> None:
    want = {"token_id:1": -1.0, "token_id:2": -2.0}
    assert logprob_gap({"token_id:1": -1.0, "token_id:2": -2.0}, want) == 0
    assert logprob_gap({"token_id:1": -1.25, "token_id:2": -2.0}, want) == 0.25


def test_a_different_top_k_is_an_infinite_gap() -> None:
    got = {"token_id:1": -1.0, "token_id:3": -2.0}
    assert math.isinf(logprob_gap(got, {"token_id:1": -1.0, "token_id:2": -2.0}))


def test_tolerance_sits_between_fp32_noise_and_wrong_kv() -> None:
    """docs/engines.md: fp32 reordering moved logprobs by <5e-7, a wrong prefix by >0.05."""
    assert 5e-7 * 100 < LOGPROB_TOLERANCE < 0.05 / 100
