"""The in-memory session index: one taker per holding, newest turn wins, bounded, expiring."""

from __future__ import annotations

import pytest

from agentkv_server.router.sessions import Holding, InMemoryStore, Ticket, holding_from_params
from agentkv_server.testing import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> InMemoryStore:
    return InMemoryStore(max_sessions=2, ticket_ttl_s=30.0, clock=clock)


def holding(
    session: str = "s",
    *,
    issued_at: float = 1000.0,
    expires_at: float = 1100.0,
    request_id: str = "r",
) -> Holding:
    return Holding(
        session, "http://d", "m", {"remote_request_id": request_id}, 100, expires_at, issued_at
    )


async def test_a_holding_is_taken_once(store: InMemoryStore):
    await store.offer(holding())
    assert await store.take("s") == holding()
    assert await store.take("s") is None


async def test_newer_turn_replaces_and_older_is_refused(store: InMemoryStore):
    old, new = holding(issued_at=1.0, request_id="old"), holding(issued_at=2.0, request_id="new")
    assert await store.offer(old) == []
    assert await store.offer(new) == [old]
    assert await store.offer(old) == [old]
    assert await store.take("s") == new


async def test_lru_eviction_returns_the_evicted(store: InMemoryStore):
    a, b, c = holding("a"), holding("b"), holding("c")
    await store.offer(a)
    await store.offer(b)
    assert await store.offer(c) == [a]
    assert await store.count() == 2


async def test_expired_holdings_are_neither_taken_nor_counted(
    store: InMemoryStore, clock: ManualClock
):
    await store.offer(holding(expires_at=1010.0))
    clock.now = 1010.0
    assert await store.count() == 0
    assert await store.take("s") is None


async def test_end_refuses_turns_issued_before_it(store: InMemoryStore):
    await store.offer(holding(issued_at=1.0))
    assert await store.end("s", at=5.0) is not None
    late = holding(issued_at=4.0)
    assert await store.offer(late) == [late]
    assert await store.offer(holding(issued_at=6.0)) == []


async def test_tickets_pop_once_and_expire(store: InMemoryStore, clock: ManualClock):
    ticket = Ticket("t", "s", "http://d", "m", 1000.0, 60.0)
    await store.add_ticket(ticket)
    assert await store.pop_ticket("t") == ticket
    assert await store.pop_ticket("t") is None
    await store.add_ticket(ticket)
    clock.now += 31
    assert await store.pop_ticket("t") is None


def test_holding_expiry_prefers_the_engines_report_minus_the_margin():
    ticket = Ticket("t", "s", "http://d", "m", 1.0, retention_s=60.0)
    reported = holding_from_params(
        ticket,
        {"remote_num_tokens": 10, "agentkv_expires_in_seconds": 30.0},
        now=100.0,
        safety_margin_s=2.0,
    )
    assert reported is not None and reported.expires_at == 128.0
    upstream = holding_from_params(
        ticket, {"remote_num_tokens": 10}, now=100.0, safety_margin_s=2.0
    )
    assert upstream is not None and upstream.expires_at == 158.0


@pytest.mark.parametrize(
    "params",
    [{}, {"remote_num_tokens": 0}, {"remote_num_tokens": 5, "agentkv_expires_in_seconds": 1.0}],
)
def test_unusable_params_make_no_holding(params):
    ticket = Ticket("t", "s", "http://d", "m", 1.0, retention_s=60.0)
    assert holding_from_params(ticket, params, now=100.0, safety_margin_s=2.0) is None


def test_holding_round_trips_through_json():
    assert Holding.from_json(holding().to_json()) == holding()


def test_records_written_before_the_session_key_rename_still_read():
    """A router of the previous release stored ``session_id``: during a rolling upgrade on a
    shared Redis, the new routers read those holdings and tickets instead of failing them."""
    old_holding = holding().to_json().replace('"session_key"', '"session_id"')
    assert Holding.from_json(old_holding) == holding()
    ticket = Ticket("t", "s", "http://d", "m", 1.0, retention_s=60.0)
    assert Ticket.from_json(ticket.to_json().replace('"session_key"', '"session_id"')) == ticket
