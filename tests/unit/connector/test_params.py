"""Reading the router's agentkv_ fields from kv_transfer_params."""

from __future__ import annotations

import pytest

from agentkv_server.connector.params import expires_within, release_ids, retention_seconds, ticket


@pytest.mark.parametrize(
    ("value", "expected"),
    [(30, 30.0), ("12.5", 12.5), (0, 0.0), (-5, 0.0), (10_000, 480.0), (480, 480.0)],
)
def test_retention_is_the_hint_clamped_to_zero_and_the_cap(value: object, expected: float) -> None:
    params = {"agentkv_retention_seconds": value}
    assert retention_seconds(params, default=100.0, maximum=480.0) == expected


@pytest.mark.parametrize("value", ["soon", None, float("nan"), [1]])
def test_unusable_or_missing_retention_falls_back_to_the_default(value: object) -> None:
    params = {} if value is None else {"agentkv_retention_seconds": value}
    assert retention_seconds(params, default=100.0, maximum=480.0) == 100.0


def test_default_is_capped_too() -> None:
    assert retention_seconds({}, default=480.0, maximum=60.0) == 60.0


def test_release_ids() -> None:
    assert release_ids({"agentkv_release": ["a", "b"]}) == ["a", "b"]
    assert release_ids({"agentkv_release": []}) == []
    assert release_ids({}) == []
    assert release_ids(None) == []


@pytest.mark.parametrize("value", ["a", 3, {"a": 1}])
def test_release_that_is_not_a_list_is_ignored(value: object) -> None:
    assert release_ids({"agentkv_release": value}) == []


def test_ticket() -> None:
    assert ticket({"agentkv_ticket": "t-1"}) == "t-1"
    assert ticket({"agentkv_ticket": ""}) is None
    assert ticket({}) is None
    assert ticket(None) is None


def test_expires_within_compares_the_deadline_with_now_plus_margin() -> None:
    params = {"agentkv_expires_at": 1000.0}
    assert not expires_within(params, 5.0, now=990.0)
    assert expires_within(params, 5.0, now=995.0)
    assert expires_within(params, 0.0, now=1000.0)


@pytest.mark.parametrize("params", [{}, {"agentkv_expires_at": None}, {"agentkv_expires_at": "x"}])
def test_a_holding_without_a_usable_deadline_is_not_expired(params: dict) -> None:
    assert not expires_within(params, 5.0, now=1e12)
