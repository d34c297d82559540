"""The deadline table behind the pull timeout."""

from __future__ import annotations

from agentkv_server.connector.deadlines import Deadlines


def test_pop_overdue_returns_and_forgets_only_expired_keys() -> None:
    table = Deadlines()
    table.set("a", 10.0)
    table.set("b", 20.0)
    assert table.pop_overdue(9.9) == []
    assert table.pop_overdue(10.0) == ["a"]
    assert "a" not in table and "b" in table
    assert table.pop_overdue(10.0) == []


def test_first_deadline_counts() -> None:
    table = Deadlines()
    table.set("a", 10.0)
    table.set("a", 99.0)  # the scheduler may hand the same pull over twice
    assert table.pop_overdue(10.0) == ["a"]


def test_discard() -> None:
    table = Deadlines()
    table.set("a", 10.0)
    table.discard("a")
    table.discard("never")
    assert len(table) == 0
    assert table.pop_overdue(100.0) == []
