"""Keeping holdings: the session lifecycle over the session store.

The orchestrator and the app go through the keeper only: it takes a session's holding for a
turn, issues tickets, records what decode engines report, ends sessions and releases KV.

A holding that will not be pulled (replaced by a newer turn, refused after a session ended,
evicted, or skipped by the policy) still occupies decode memory until it expires; the keeper
sends the release request of docs/protocol.md section 5 so the engine frees it now. One whose
pull waits in the router's queue is renewed on its engine instead, so that it does not expire
while its turn waits (``keep_while``). Releases
run in the background, but those a decode step needs the room of go with the step itself
(``make_room``).

With a capacity ledger (capacity.py) the keeper also keeps each decode engine's holdings within
budget: the holdings the ledger names (abandoned ones, then the least valuable) are taken out
of the store first, so that no turn can plan a pull of blocks being freed, then released.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from agentkv_server import wire
from agentkv_server.router import codec
from agentkv_server.router.capacity import CapacityLedger, ReleaseReason
from agentkv_server.router.http_client import HTTPClient, HTTPError, Timeout
from agentkv_server.router.resilient_store import ResilientStore
from agentkv_server.router.sessions import Holding, Ticket, holding_from_params

__all__ = ["HoldingKeeper", "Taken"]


class Taken(NamedTuple):
    """What a turn found of its session's holding."""

    holding: Holding | None
    released: ReleaseReason | None = None
    """Found none because it went to make room: why (``pressure``, ``live_turn``,
    ``abandoned``); None otherwise."""
    in_host_tier: Holding | None = None
    """That released holding, when its KV is likely in its engine's host tier (capacity.py):
    the turn can continue there and load it back."""


logger = logging.getLogger(__name__)

# Tickets kept in this process whose holding never came (their turn failed) are dropped oldest
# first beyond this many.
_MAX_TICKETS = 4096
# Releases within this long of each other go to their engine as one request.
_RELEASE_BATCH_S = 0.005


class HoldingKeeper:
    """The router's side of the holdings protocol, over the session store (its only user)."""

    def __init__(
        self,
        store: ResilientStore,
        http: HTTPClient,
        *,
        safety_margin_s: float,
        release_timeout_s: float,
        releases_enabled: bool,
        ledger: CapacityLedger | None = None,
        sweep_s: float = 1.0,
        renew_s: float = 60.0,
        renew_margin_s: float = 10.0,
    ) -> None:
        self._store = store
        self._http = http
        self._safety_margin_s = safety_margin_s
        self._release_timeout = Timeout(total=release_timeout_s)
        self._releases_enabled = releases_enabled
        self._ledger = ledger
        self._sweep_s = sweep_s
        self._renew_s = renew_s
        self._renew_margin_s = renew_margin_s
        self._sweeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Tickets issued here whose holding is not recorded yet, each with the event it sets.
        self._unrecorded: dict[str, asyncio.Event] = {}
        # Tickets of non-streamed turns (their holding comes back in the answer, to this router);
        # None once used, so that the answer and the engine's report of one turn never ask the
        # store for a ticket it never had.
        self._own_tickets: dict[str, Ticket | None] = {}
        # Request ids to release, by (decode engine, model), and the task that will send them.
        self._pending: dict[tuple[str, str], list[str]] = {}
        self._flush: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    @property
    def keeps_holdings(self) -> bool:
        """False while the store is out: nothing could record a turn's KV, so keep none."""
        return self._store.available

    async def take(self, session_key: str) -> Taken:
        """The session's holding for this turn; a concurrent turn of the session gets none."""
        holding = await self._store.take(session_key)
        released = self._ledger.taken(session_key, holding) if self._ledger is not None else None
        if released is None:
            return Taken(holding)
        return Taken(holding, released.reason, released.in_host_tier)

    def pull_started(self, holding: Holding) -> None:
        """A turn pulls ``holding``: its blocks stay on the engine until read (capacity.py)."""
        if self._ledger is not None:
            self._ledger.pull_started(holding)

    def pull_ended(self, holding: Holding) -> None:
        """The pull's prefill step ended: the holding was read, or is being released."""
        if self._ledger is not None:
            self._ledger.pull_ended(holding)

    async def issue(
        self,
        session_key: str,
        decode_url: str,
        model: str,
        retention_s: float,
        *,
        streamed: bool,
        next_turn_s: float | None = None,
    ) -> Ticket:
        """A ticket for the holding a decode step is to keep.

        A streamed turn's holding comes only in the engine's report, which may reach another
        router: its ticket goes to the shared store. A non-streamed turn's comes back in the
        answer, to this router: its ticket stays here, which saves two store round trips (Redis)
        per turn.
        """
        ticket = Ticket(
            ticket=os.urandom(16).hex(),  # 128 random bits, as uuid4 (a third the CPU)
            session_key=session_key,
            decode_url=decode_url,
            model=model,
            issued_at=time.time(),
            retention_s=retention_s,
            next_turn_s=next_turn_s,
        )
        if streamed:
            await self._store.add_ticket(ticket)
            _bounded_put(self._unrecorded, ticket.ticket, asyncio.Event())
        else:
            _bounded_put(self._own_tickets, ticket.ticket, ticket)
        return ticket

    async def wait_recorded(self, ticket_id: str, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until the ticket's holding is recorded.

        A streamed turn's holding arrives in the decode engine's report, sent as the request
        finishes; an agent sends its next turn as soon as the stream ends. Holding back the
        stream's last event until the report is in closes that race. False on timeout.
        """
        event = self._unrecorded.get(ticket_id)
        if event is None:
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            logger.debug("no holding report for ticket %s within %.2f s", ticket_id, timeout)
            return False
        finally:
            self._unrecorded.pop(ticket_id, None)
        return True

    async def record(
        self, ticket_id: str, params: Mapping[str, Any], *, reported: bool = False
    ) -> Holding | None:
        """Turn a decode engine's returned params into the session's holding.

        Called from the response body and from the engine's report (``reported``); the first
        pops the ticket, the second finds none and does nothing. The stream waiting on the
        ticket goes on once the holding is in the store, so the client's next turn finds it;
        a report that reached a router other than the stream's is announced to it.
        """
        awaited = self._unrecorded.pop(ticket_id, None)
        shared = ticket_id not in self._own_tickets
        if self._ledger is not None:
            recorded = params.get(wire.REMOTE_NUM_TOKENS)
            self._ledger.step_ended(ticket_id, recorded if isinstance(recorded, int) else None)
        try:
            ticket = await self._pop_ticket(ticket_id)
            holding = None if ticket is None else await self._record(ticket, params)
        finally:
            if awaited is not None:
                awaited.set()
        if shared and ticket is not None and awaited is None and reported:
            await self._store.announce_recorded(ticket_id)
        return holding

    async def _pop_ticket(self, ticket_id: str) -> Ticket | None:
        if ticket_id in self._own_tickets:
            ticket, self._own_tickets[ticket_id] = self._own_tickets[ticket_id], None
            return ticket
        return await self._store.pop_ticket(ticket_id)

    async def _record(self, ticket: Ticket, params: Mapping[str, Any]) -> Holding | None:
        holding = holding_from_params(
            ticket, params, now=time.time(), safety_margin_s=self._safety_margin_s
        )
        if holding is None:
            return None
        return await self._keep(holding, ticket.next_turn_s)

    async def give_back(self, holding: Holding) -> None:
        """A turn took ``holding`` and was refused before using it: the session keeps it for
        the client's next try (unless a newer one was recorded meanwhile)."""
        await self._keep(holding, None)

    async def _keep(self, holding: Holding, next_turn_s: float | None) -> Holding | None:
        """``holding`` in the store and the ledger; None when it was refused or released."""
        losers = await self._store.offer(holding)
        self.release_soon(losers)
        if holding in losers:
            return None
        if self._ledger is None:
            return holding
        for loser in losers:
            self._ledger.discard(loser.session_key, loser)
        if victims := self._ledger.add(holding, next_turn_s):
            await self._evict(victims)
        return None if holding in victims else holding

    async def make_room(
        self,
        decode_url: str,
        tokens: int,
        running: int,
        step: str | None = None,
        output_limit: int | None = None,
    ) -> list[Holding]:
        """Before a decode step of ``tokens`` (and an answer of at most ``output_limit``)
        beside ``running`` others: the least valuable holdings the step would not fit beside,
        taken out of the store for the step to release (``agentkv_release`` with the step: the
        engine frees them as it arrives, before it waits for blocks; a release of their own
        waited for blocks itself, 1-1.9 s on the pressure preset). If the step fails,
        :meth:`release_soon` them. A step with a ticket (``step``) keeps its room reserved
        until its KV is recorded."""
        if self._ledger is None or not self._releases_enabled:
            return []
        victims = self._ledger.make_room(decode_url, tokens, running, step, output_limit)
        return await self._take_out(victims)

    @contextlib.contextmanager
    def released_if_failed(self, releases: list[Holding]) -> Iterator[None]:
        """Around a decode step that carries ``releases``: if it fails, release them on their
        own (the engine may never have seen the step; a second release is ignored)."""
        try:
            yield
        except BaseException:
            self.release_soon(releases)
            raise

    async def _evict(self, victims: Iterable[Holding]) -> None:
        self.release_soon(await self._take_out(victims))

    async def _take_out(self, victims: Iterable[Holding]) -> list[Holding]:
        """``victims`` taken out of the store, to release; one that a turn took already is
        that turn's to pull or release, and a newer holding found instead goes back."""
        taken = []
        for victim in victims:
            current = await self._store.take(victim.session_key)
            if current is None:
                continue
            if current != victim:
                self.release_soon(await self._store.offer(current))
                continue
            taken.append(victim)
        return taken

    def start(self) -> None:
        """Hear of holdings that other routers sharing the store recorded for this one, and
        forget expired holdings every ``sweep_s``."""
        self._watch = asyncio.create_task(
            self._store.watch_recorded(self._recorded_elsewhere), name="agentkv-recorded"
        )
        if self._ledger is not None:
            self._sweeper = asyncio.create_task(self._sweep_loop(), name="agentkv-sweep")

    def sweep(self) -> None:
        """Forget the holdings that expired (the engines freed them themselves)."""
        if self._ledger is not None:
            self._ledger.sweep()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            try:
                self.sweep()
            except Exception:  # the next sweep tries again; the loop must outlive a bad one
                logger.exception("sweeping holdings failed")

    def _recorded_elsewhere(self, ticket_id: str) -> None:
        if self._ledger is not None:
            self._ledger.step_ended(ticket_id)
        if (awaited := self._unrecorded.pop(ticket_id, None)) is not None:
            awaited.set()

    async def void(self, ticket_id: str) -> None:
        """Forget a ticket whose decode step broke: a late report of it records nothing."""
        if self._ledger is not None:
            self._ledger.step_ended(ticket_id)
        self._unrecorded.pop(ticket_id, None)
        await self._pop_ticket(ticket_id)

    async def end(self, session_key: str) -> tuple[Holding | None, bool]:
        """End a session now: drop its holding and release it. Returns (holding, released)."""
        holding = await self._store.end(session_key, time.time())
        if self._ledger is not None:
            self._ledger.ended(session_key)
        if holding is None:
            return None, False
        return holding, await self.release(holding)

    async def end_soon(self, session_key: str) -> None:
        """After a session's last turn: refuse holdings of turns still in flight, and free any
        kept in the background."""
        holding = await self._store.end(session_key, time.time())
        if self._ledger is not None:
            self._ledger.ended(session_key)
        if holding is not None:
            self.release_soon([holding])

    def release_soon(self, holdings: Iterable[Holding]) -> None:
        """Release in the background, one request per engine for what is released within
        ``_RELEASE_BATCH_S`` of each other (under load, most turns release a holding)."""
        if not self._releases_enabled:
            return
        for holding in holdings:
            if request_ids := holding.request_ids():
                pending = self._pending.setdefault((holding.decode_url, holding.model), [])
                pending.extend(request_ids)
        if self._pending and self._flush is None:
            self._flush = self._in_background(self._release_pending())

    async def _release_pending(self) -> None:
        await asyncio.sleep(_RELEASE_BATCH_S)
        pending, self._pending, self._flush = self._pending, {}, None
        for (decode_url, model), request_ids in pending.items():
            self._in_background(self._release(decode_url, model, request_ids))

    def _in_background(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def release(self, holding: Holding) -> bool:
        """Ask the holding's decode engine to free its blocks now; False if it could not."""
        request_ids = holding.request_ids()
        if not self._releases_enabled or not request_ids:
            return False
        return await self._release(holding.decode_url, holding.model, request_ids)

    async def keep_while(self, holding: Holding, waiting: asyncio.Future[Any]) -> Holding:
        """``holding`` kept on its engine until ``waiting`` is done (its turn held in the
        router's queue): whenever it comes within ``renew_margin_s`` of its expiry, its engine is
        asked to keep it that margin and ``renew_s`` more. The holding as it stands at the end; one whose
        engine did not answer is left to its expiry (the pull then finds it gone, and P
        recomputes)."""
        while not waiting.done():
            due_s = holding.expires_at - self._renew_margin_s - time.time()
            if due_s > 0:
                await asyncio.wait({waiting}, timeout=due_s)
                continue
            renewed = await self.renew(holding, self._renew_margin_s + self._renew_s)
            if renewed is None:
                await asyncio.wait({waiting})
                break
            holding = renewed
        return holding

    async def renew(self, holding: Holding, seconds: float) -> Holding | None:
        """Ask the holding's engine to keep it ``seconds`` from now: the holding with its
        expiry moved as far, or None when the engine did not take the request."""
        request_ids = holding.request_ids()
        if not self._releases_enabled or not request_ids:
            return None
        body = wire.renew_body(holding.model, dict.fromkeys(request_ids, seconds))
        try:
            answer = await self._http.fetch(
                f"{holding.decode_url}/v1/completions",
                self._release_timeout,
                json=codec.dumps(body),
            )
        except (HTTPError, asyncio.TimeoutError) as exc:
            logger.warning("renewing a holding on %s failed: %r", holding.decode_url, exc)
            return None
        if answer.status != 200:
            logger.warning("renewing a holding on %s: HTTP %d", holding.decode_url, answer.status)
            return None
        now = time.time()
        return dataclasses.replace(
            holding,
            params=wire.renewed_params(holding.params, seconds, now=now),
            expires_at=now + seconds - self._safety_margin_s,
        )

    async def _release(self, decode_url: str, model: str, request_ids: list[str]) -> bool:
        body = wire.release_body(model, request_ids)
        try:
            answer = await self._http.fetch(
                f"{decode_url}/v1/completions", self._release_timeout, json=codec.dumps(body)
            )
        except (HTTPError, asyncio.TimeoutError) as exc:
            logger.debug("release on %s failed: %r", decode_url, exc)
            return False
        return answer.status == 200

    async def drain(self) -> None:
        """Stop watching and sweeping, and wait for background releases (at shutdown)."""
        for task in (self._watch, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._watch = self._sweeper = None
        while self._background:  # a batch's flush starts the batch's requests
            await asyncio.gather(*self._background, return_exceptions=True)


def _bounded_put(items: dict[str, Any], key: str, value: Any) -> None:
    if len(items) >= _MAX_TICKETS:
        del items[next(iter(items))]
    items[key] = value
