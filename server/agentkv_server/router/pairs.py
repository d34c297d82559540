"""Pair health: which (prefill, decode) engine pairs move KV between them, and which do not.

In a P/D turn the decode engine D reads the prompt's KV from the prefill engine P (and in a
pull, P reads the session's history from its holder D). A read that fails or stalls does not
fail the turn: the engine's connector gives up on it and the engine computes the prompt itself
(``kv_load_failure_policy=recompute``), slowly. The connector says so in the params it returns,
``agentkv_kv_load`` (docs/protocol.md section 5), which reach the router in D's answer, a
streamed Responses answer's last event, D's holding report (streamed turns with a ticket), or
P's answer (a pull).

A pair whose last transfer failed is *bad*: a P/D turn goes over it only when no healthy engine
forms a good pair with the turn's other engine. ``pairs.retry_s`` after the failure the pair is
up for a *retry*: the next turn that may use it does (a trial), and the pair waits as long again
before another. Each failure in a row doubles the wait, up to ``pairs.max_retry_s``; one good transfer
makes the pair good at once (docs/router.md, "Pair health").

Health is per router: a replica learns from the turns it serves (a holding report that reaches
another replica teaches that one nothing).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from agentkv_server import wire
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.placement import Engine, EnginePool
from agentkv_server.settings import PairSettings

__all__ = ["PairHealth", "PairState", "take_kv_load"]

logger = logging.getLogger(__name__)

PairState = Literal["good", "retry", "bad"]
"""``good``: no failure since its last good transfer (or none yet); ``bad``: its last transfer
failed; ``retry``: bad, and past its retry time, so one turn tests it."""

# Which pairs a pick tries first: one to retry, then good pairs, then bad ones.
_RANK: Mapping[PairState, int] = {"retry": 0, "good": 1, "bad": 2}
# Tickets of decode steps whose outcome is awaited (a report may never come): the oldest go.
_MAX_TICKETS = 4096

Clock = Callable[[], float]


@dataclass
class _Pair:
    failures: int = 0  # in a row; 0: good
    retry_at: float = 0.0  # monotonic time from which a bad pair is retried


class PairHealth:
    """Transfer health of each (prefill URL, decode URL) pair, and picks that respect it."""

    def __init__(
        self,
        settings: PairSettings,
        *,
        metrics: RouterMetrics | None = None,
        pairs: Iterable[tuple[str, str]] = (),
        clock: Clock = time.monotonic,
    ) -> None:
        self._retry_s = settings.retry_s
        self._max_retry_s = settings.max_retry_s
        self._metrics = metrics
        self.clock = clock  # monotonic seconds; tests set their own
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._failing = 0  # pairs whose last transfer failed: while 0, every pair is good
        self._tickets: OrderedDict[str, tuple[str, str]] = OrderedDict()
        if metrics is not None:
            for prefill, decode in pairs:  # every pair is good until it fails
                metrics.set_pair_healthy(prefill, decode, True)

    def state(self, prefill: str, decode: str) -> PairState:
        pair = self._pairs.get((prefill, decode))
        if pair is None or pair.failures == 0:
            return "good"
        return "retry" if self.clock() >= pair.retry_at else "bad"

    def record(self, prefill: str, decode: str, ok: bool) -> None:
        """One transfer between the pair ended: well (good at once) or not (bad for a while)."""
        key = (prefill, decode)
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = _Pair()
        elif ok and pair.failures == 0:  # the usual case: good and still good
            if self._metrics is not None:
                self._metrics.record_pair_transfer(prefill, decode, wire.KV_LOAD_OK)
            return
        was_good = pair.failures == 0
        if ok:
            if not was_good:
                pair.failures = 0
                self._failing -= 1
                logger.warning("KV transfers between %s and %s work again", prefill, decode)
        else:
            self._failing += was_good
            pair.failures += 1
            wait = self._wait(pair.failures)
            pair.retry_at = self.clock() + wait
            logger.warning(
                "a KV transfer between %s and %s failed (%d in a row): P/D turns avoid the "
                "pair for %.0f s",
                prefill, decode, pair.failures, wait,
            )  # fmt: skip
        if self._metrics is not None:
            self._metrics.record_pair_transfer(
                prefill, decode, wire.KV_LOAD_OK if ok else wire.KV_LOAD_FAILED
            )
            self._metrics.set_pair_healthy(prefill, decode, pair.failures == 0)

    def record_params(self, prefill: str | None, decode: str | None, params: Any) -> None:
        """Record the load outcome an engine returned in ``params`` for the pair (None: the
        step read nothing from an engine of the other role). The outcome is taken out of
        ``params`` either way."""
        ok = take_kv_load(params)
        if ok is not None and prefill is not None and decode is not None:
            self.record(prefill, decode, ok)

    def expect(self, ticket: str, prefill: str, decode: str) -> None:
        """A decode step with this ticket reads its prompt's KV from ``prefill``: its outcome
        comes in its answer or its holding report, whichever :meth:`record_ticket` sees first."""
        if len(self._tickets) >= _MAX_TICKETS:
            self._tickets.popitem(last=False)
        self._tickets[ticket] = (prefill, decode)

    def record_ticket(self, ticket: str, params: Any) -> None:
        """Record the outcome in a ticketed step's answer or report, once per ticket (an answer
        without one, as a chat stream's, leaves it to the report)."""
        ok = take_kv_load(params)
        if ok is None:
            return
        pair = self._tickets.pop(ticket, None)
        if pair is not None:
            self.record(*pair, ok)

    def pick(
        self,
        pool: EnginePool,
        partner: str | None,
        *,
        prefer: str | None = None,
        exclude: Iterable[Engine] = (),
        trial: bool = True,
    ) -> Engine | None:
        """``pool.pick`` among the healthy engines whose pair with ``partner`` (the turn's
        engine of the other role) ranks best: one to retry, else a good one, else a bad one.

        Engine health comes first (a down engine fails the step; a bad pair only slows it):
        with no healthy engine left, the pool's own last resort applies. Picking a pair to retry
        starts its trial (unless not ``trial``: the step moves no KV between the two): the pair
        waits again before another turn tests it.
        """
        if partner is None or not self._failing:  # every pair good: health alone decides
            return pool.pick(prefer=prefer, exclude=exclude)
        excluded = set(exclude)
        ranks = {
            engine: _RANK[self.state(*_key(pool, partner, engine))]
            for engine in pool.engines
            if engine.healthy and engine not in excluded
        }
        if ranks:
            best = min(ranks.values())
            excluded.update(engine for engine in pool.engines if ranks.get(engine) != best)
        engine = pool.pick(prefer=prefer, exclude=excluded)
        if engine is not None and trial:
            self._start_trial(_key(pool, partner, engine))
        return engine

    def _start_trial(self, key: tuple[str, str]) -> None:
        pair = self._pairs.get(key)
        if pair is not None and pair.failures and self.clock() >= pair.retry_at:
            logger.info("testing KV transfers between %s and %s with one turn", *key)
            pair.retry_at = self.clock() + self._wait(pair.failures)

    def _wait(self, failures: int) -> float:
        return min(self._retry_s * 2 ** min(failures - 1, 30), self._max_retry_s)


def take_kv_load(params: Any) -> bool | None:
    """Take the load outcome out of an engine's returned params: True (``ok``), False
    (``failed``), None when they carry none. The fields go: a holding's params are sent on to
    the next turn's prefill engine, and a prefill engine's to the decode engine."""
    if not isinstance(params, dict):
        return None
    outcome = params.pop(wire.KV_LOAD, None)
    params.pop(wire.KV_LOAD_FROM, None)
    params.pop(wire.KV_LOAD_SYNC, None)
    if outcome == wire.KV_LOAD_OK:
        return True
    if outcome == wire.KV_LOAD_FAILED:
        return False
    return None


def _key(pool: EnginePool, partner: str, engine: Engine) -> tuple[str, str]:
    return (partner, engine.url) if pool.role == "decode" else (engine.url, partner)
