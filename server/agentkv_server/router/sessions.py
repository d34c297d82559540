"""The session index: at most one KV holding per session, and the tickets that produce them.

A *holding* is where a session's last turn left its KV: the decode engine that retains the
blocks, the ``kv_transfer_params`` it returned (opaque here, except ``remote_num_tokens`` and
``agentkv_expires_in_seconds``), and an expiry. A *ticket* is issued per decode step so that the
engine's report (streamed turns) or its response body (non-streamed) can be tied back to the
session; whichever arrives first pops the ticket, so a holding is recorded once.

Stores are asynchronous and atomic per operation: ``take`` hands a holding to exactly one turn
even when two turns of a session run at once. Times are wall-clock (``time.time``) because a
Redis store is shared by replicas on different machines.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from agentkv_server import wire

__all__ = [
    "Holding",
    "InMemoryStore",
    "SessionStore",
    "Ticket",
    "holding_from_params",
]

Clock = Callable[[], float]


@dataclass(frozen=True)
class Holding:
    """KV a decode engine retains for a session's next turn.

    ``session_key`` is the store's key: the client's session id within its tenant's namespace
    (auth.session_key), never shown to clients.
    """

    session_key: str
    decode_url: str
    model: str
    params: dict[str, Any] = field(hash=False)
    num_tokens: int
    expires_at: float
    issued_at: float

    def remaining_s(self, now: float) -> float:
        return self.expires_at - now

    def request_ids(self) -> list[str]:
        """The engine-side request ids whose blocks a release frees."""
        request_id = self.params.get(wire.REMOTE_REQUEST_ID)
        return [request_id] if isinstance(request_id, str) else []

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Holding:
        return cls(**_stored_fields(raw))


@dataclass(frozen=True)
class Ticket:
    """One decode step awaiting its holding report."""

    ticket: str
    session_key: str
    decode_url: str
    model: str
    issued_at: float
    retention_s: float
    next_turn_s: float | None = None
    """The client's predicted seconds to the session's next turn, if it sent one."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Ticket:
        return cls(**_stored_fields(raw))


def _stored_fields(raw: str | bytes) -> dict[str, Any]:
    """A stored record's fields; records of routers before the ``session_key`` rename read too,
    so a rolling upgrade on a shared Redis keeps the sessions held at the switch."""
    fields: dict[str, Any] = json.loads(raw)
    if "session_id" in fields:
        fields["session_key"] = fields.pop("session_id")
    return fields


def holding_from_params(
    ticket: Ticket, params: Mapping[str, Any], *, now: float, safety_margin_s: float
) -> Holding | None:
    """The holding that a decode engine's returned params describe, or None if nothing usable.

    Expiry is the engine's own ``agentkv_expires_in_seconds`` when it reports one (an upstream
    engine does not: then the retention the router asked for), minus a safety margin.
    """
    num_tokens = params.get(wire.REMOTE_NUM_TOKENS)
    if not isinstance(num_tokens, int) or num_tokens <= 0:
        return None
    expires_in = params.get(wire.EXPIRES_IN_SECONDS)
    if not isinstance(expires_in, (int, float)) or isinstance(expires_in, bool):
        expires_in = ticket.retention_s
    expires_at = now + float(expires_in) - safety_margin_s
    if expires_at <= now:
        return None
    return Holding(
        session_key=ticket.session_key,
        decode_url=ticket.decode_url,
        model=ticket.model,
        params=dict(params),
        num_tokens=num_tokens,
        expires_at=expires_at,
        issued_at=ticket.issued_at,
    )


class SessionStore(Protocol):
    """Where holdings and tickets live; every method is atomic."""

    async def take(self, session_key: str) -> Holding | None:
        """Remove and return the session's unexpired holding: one caller gets it, ever."""

    async def offer(self, holding: Holding) -> list[Holding]:
        """Record a holding unless a newer one (or the session's end) supersedes it.

        Returns the holdings that lost (replaced, refused or evicted), for release.
        """

    async def end(self, session_key: str, at: float) -> Holding | None:
        """End a session: take its holding and refuse holdings from turns issued before ``at``."""

    async def add_ticket(self, ticket: Ticket) -> None: ...

    async def pop_ticket(self, ticket_id: str) -> Ticket | None: ...

    async def announce_recorded(self, ticket_id: str) -> None:
        """Tell the other routers sharing this store that the ticket's holding is recorded."""

    async def watch_recorded(self, on_recorded: Callable[[str], None]) -> None:
        """Call ``on_recorded`` with each ticket another router announces, until cancelled;
        returns at once when no other router can share the store."""

    async def count(self) -> int:
        """Unexpired holdings."""

    async def close(self) -> None: ...


class _BoundedTTL:
    """An LRU-bounded mapping whose entries also expire."""

    def __init__(self, max_items: int, clock: Clock) -> None:
        self._items: OrderedDict[str, tuple[Any, float]] = OrderedDict()
        self._max = max_items
        self._clock = clock

    def put(self, key: str, value: Any, expires_at: float) -> list[Any]:
        """Insert as most recent; returns the values evicted to stay within bounds."""
        self._items[key] = (value, expires_at)
        self._items.move_to_end(key)
        evicted = []
        while len(self._items) > self._max:
            _, (old, _) = self._items.popitem(last=False)
            evicted.append(old)
        return evicted

    def get(self, key: str) -> Any | None:
        entry = self._items.get(key)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    def pop(self, key: str) -> Any | None:
        entry = self._items.pop(key, None)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    def live_count(self) -> int:
        now = self._clock()
        for key in [k for k, (_, expires_at) in self._items.items() if expires_at <= now]:
            del self._items[key]
        return len(self._items)


class InMemoryStore:
    """One process's session index: LRU-bounded, expired entries dropped on access.

    Operations never await, so each is atomic on the event loop.
    """

    def __init__(self, *, max_sessions: int, ticket_ttl_s: float, clock: Clock = time.time):
        self._clock = clock
        self._ticket_ttl_s = ticket_ttl_s
        self._holdings = _BoundedTTL(max_sessions, clock)
        self._ended = _BoundedTTL(max_sessions, clock)
        self._tickets = _BoundedTTL(max_sessions, clock)

    async def take(self, session_key: str) -> Holding | None:
        return self._holdings.pop(session_key)

    async def offer(self, holding: Holding) -> list[Holding]:
        ended_at = self._ended.get(holding.session_key)
        current = self._holdings.get(holding.session_key)
        if (ended_at is not None and ended_at >= holding.issued_at) or (
            current is not None and current.issued_at > holding.issued_at
        ):
            return [holding]
        evicted = self._holdings.put(holding.session_key, holding, holding.expires_at)
        now = self._clock()
        losers = [current] if current is not None else []
        return losers + [old for old in evicted if old.expires_at > now]

    async def end(self, session_key: str, at: float) -> Holding | None:
        self._ended.put(session_key, at, self._clock() + self._ticket_ttl_s)
        return self._holdings.pop(session_key)

    async def add_ticket(self, ticket: Ticket) -> None:
        self._tickets.put(ticket.ticket, ticket, self._clock() + self._ticket_ttl_s)

    async def pop_ticket(self, ticket_id: str) -> Ticket | None:
        return self._tickets.pop(ticket_id)

    async def announce_recorded(self, ticket_id: str) -> None:
        return None  # one process: no other router to tell

    async def watch_recorded(self, on_recorded: Callable[[str], None]) -> None:
        return None

    async def count(self) -> int:
        return self._holdings.live_count()

    async def close(self) -> None:
        return None
