"""Sends planned sessions as agents' own clients would: each tenant with its API key, openai's
default retries on, every HTTP try of a turn recorded (bench/attempts.py).

The mode comparison's :class:`~agentkv_server.bench.runner.Runner` turns retries off, so that a
failure shows as one; the overload and ``agents12`` presets measure what an agent meets, retries
included: a turn refused at arrival and served on a retry counts as served, its TTFT from the
first try. A turn that gets no answer ends its session (the conversation cannot go on without
it), so a session whose first turn is refused sends nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx

import agentkv
from agentkv_server.bench.attempts import RecordingTransport, recording
from agentkv_server.bench.planned import PlannedSession
from agentkv_server.bench.records import TenantTurn, TurnRecord
from agentkv_server.bench.runner import Target, stream_turn
from agentkv_server.bench.workload import TextTokenizer, Workload

__all__ = ["OPENAI_RETRIES", "TenantRunner", "session_id"]

# What openai's clients retry by default (max_retries).
OPENAI_RETRIES: Final = 2


def session_id(salt: str, mode: str, repeat: int, tag: str, key: str) -> str:
    """A planned session's id: unique per run (salt), mode, repeat, point (``tag``) and session
    (``key``), so that no run's prefix cache serves another's."""
    return f"bench-{salt}-{mode}-r{repeat}-{tag}-{key}"


@dataclass(frozen=True)
class _Run:
    target: Target
    repeat: int
    salt: str
    tag: str
    load: float | None
    origin: float


class TenantRunner:
    """Runs planned sessions against a :class:`Target`, all at once, each starting at its
    plan's ``start_s``. ``texts`` gives the sessions' histories and fresh input (and the output
    tokens per turn), cut with ``tokenizer``; ``new_tokenizer`` (default: the same) cuts the
    fresh input, so that a workload given in words can be sent in words."""

    def __init__(
        self,
        texts: Workload,
        tokenizer: TextTokenizer,
        *,
        new_tokenizer: TextTokenizer | None = None,
        max_retries: int = OPENAI_RETRIES,
        request_timeout_s: float = 600.0,
        on_turn: Callable[[TenantTurn], None] = lambda turn: None,
    ) -> None:
        self.texts = texts
        self.tokenizer = tokenizer
        self.new_tokenizer = new_tokenizer or tokenizer
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self._on_turn = on_turn

    async def run(
        self,
        target: Target,
        sessions: Sequence[PlannedSession],
        *,
        salt: str,
        repeat: int,
        tag: str,
        load: float | None = None,
    ) -> list[TenantTurn]:
        """Every session once; turn times count from the call. ``tag`` names the run's point
        in the session ids (:func:`session_id`)."""
        async with self._clients(target, sessions) as clients:
            run = _Run(target, repeat, salt, tag, load, time.perf_counter())
            done = await asyncio.gather(*(self._session(clients, run, s) for s in sessions))
        return [turn for turns in done for turn in turns]

    @contextlib.asynccontextmanager
    async def _clients(
        self, target: Target, sessions: Sequence[PlannedSession]
    ) -> AsyncIterator[dict[tuple[str, str], agentkv.AsyncOpenAI]]:
        """One SDK client per endpoint and API key, over one connection pool."""
        limits = httpx.Limits(max_connections=len(sessions) + 4)
        transport = RecordingTransport(httpx.AsyncHTTPTransport(limits=limits))
        async with httpx.AsyncClient(transport=transport, timeout=self.request_timeout_s) as http:
            yield {
                (url, key): agentkv.AsyncOpenAI(
                    base_url=url.rstrip("/") + "/v1",
                    api_key=key,
                    max_retries=self.max_retries,
                    http_client=http,
                    agentkv_body=target.tag_body,
                )
                for url in target.base_urls
                for key in {s.api_key for s in sessions}
            }

    async def _session(
        self,
        clients: dict[tuple[str, str], agentkv.AsyncOpenAI],
        run: _Run,
        planned: PlannedSession,
    ) -> list[TenantTurn]:
        target, plan = run.target, planned.plan
        name = session_id(run.salt, target.mode, run.repeat, run.tag, planned.key)
        client = clients[(target.url_for(name), planned.api_key)]
        history = self.texts.history_text(
            self.tokenizer, plan.history_tokens, plan.index, f"{run.salt} {name}"
        )
        messages: list[dict[str, Any]] = [{"role": "system", "content": history}]
        turns: list[TenantTurn] = []
        async with agentkv.session(name) as session:
            for number, wait in enumerate((plan.start_s, *plan.gaps_s), start=1):
                await asyncio.sleep(wait)
                if number > 1:
                    session.record_tool_time(wait)
                if number == plan.turns and plan.ends and target.ends_sessions:
                    session.end_next_turn()
                new = self.texts.new_text(
                    self.new_tokenizer, plan.history_tokens, plan.index, number
                )
                messages.append({"role": "user", "content": new})
                turn, answer = await self._turn(client, session, messages, run, planned, number)
                turns.append(turn)
                self._on_turn(turn)
                if not turn.turn.ok:
                    break
                messages.append({"role": "assistant", "content": answer})
        return turns

    async def _turn(
        self,
        client: agentkv.AsyncOpenAI,
        session: agentkv.Session,
        messages: list[dict[str, Any]],
        run: _Run,
        planned: PlannedSession,
        number: int,
    ) -> tuple[TenantTurn, str]:
        plan, target = planned.plan, run.target
        gap = plan.gaps_s[number - 2] if number > 1 else 0.0
        base = TurnRecord(target.mode, run.repeat, plan.history_tokens, plan.index, number, gap)
        output = self.texts.output_tokens
        with recording() as tries:
            record, answer = await stream_turn(
                client, target.model, session, messages, output, base, run.origin
            )
        return TenantTurn(record, planned.label, tuple(tries), planned.burst, run.load), answer
