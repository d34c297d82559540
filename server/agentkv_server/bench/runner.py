"""Drives the workload's sessions against one mode's endpoint and records every turn.

Sessions run through the agentkv SDK (``AsyncOpenAI`` inside ``agentkv.session``), exactly as an
agent would: the router sees real session ids and turn hints. Every call streams, so the time
to the first chunk is the client-side TTFT. A session holds a concurrency slot for its whole
life, tool waits included (a waiting agent is still an active conversation).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import openai

import agentkv
from agentkv_server.bench.decoders import DecodingSession, run_beside
from agentkv_server.bench.kvmemory import DecodeMemoryProbe
from agentkv_server.bench.pressure import SessionPlan
from agentkv_server.bench.records import DecodeRecord, TransferRecord, TurnRecord
from agentkv_server.bench.transfers import TransferProbe
from agentkv_server.bench.workload import TextTokenizer, Workload

__all__ = ["RunRecords", "Runner", "Target", "session_name", "stream_turn"]

# Engine-side sampling that makes every turn produce exactly ``output_tokens`` (random-weight
# test models would otherwise stop at an early end-of-sequence token).
_EXACT_LENGTH = {"ignore_eos": True}


@dataclass(frozen=True)
class Target:
    """Where one mode's traffic goes.

    Several ``base_urls`` are served with session affinity on the client: a session always
    talks to the same one. ``tag_body`` is False for plain vLLM engines (the agentkv body object
    is a router's to strip; headers alone are harmless to an engine).
    """

    mode: str
    base_urls: tuple[str, ...]
    model: str
    metrics_urls: tuple[str, ...] = ()
    tag_body: bool = True
    prefill_metrics_urls: tuple[str, ...] = ()
    ends_sessions: bool = True
    """Whether a session's last turn tells the router that the session ends."""

    def url_for(self, session_id: str) -> str:
        return self.base_urls[zlib.crc32(session_id.encode()) % len(self.base_urls)]


@dataclass(frozen=True)
class RunRecords:
    """What one run of the workload against one mode recorded."""

    turns: list[TurnRecord]
    decodes: list[DecodeRecord]
    transfers: list[TransferRecord]

    def extend(self, other: RunRecords) -> None:
        self.turns.extend(other.turns)
        self.decodes.extend(other.decodes)
        self.transfers.extend(other.transfers)


@dataclass(frozen=True)
class _Run:
    """One run of sessions against one target: what names its sessions and starts its clock."""

    target: Target
    repeat: int
    salt: str
    started: float
    pressure_sessions: int | None


@dataclass(frozen=True)
class _Turn:
    """Where one turn sits in the run."""

    run: _Run
    history: int
    session: int
    turn: int
    tool_latency_s: float


class Runner:
    """Runs a workload's sessions against a :class:`Target`; ``on_turn`` sees each record as it
    completes (the progress bar)."""

    def __init__(
        self,
        workload: Workload,
        tokenizer: TextTokenizer,
        *,
        on_turn: Callable[[TurnRecord], None] = lambda record: None,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.workload = workload
        self.tokenizer = tokenizer
        self.request_timeout_s = request_timeout_s
        self._on_turn = on_turn

    async def run(self, target: Target, repeat: int, salt: str) -> RunRecords:
        """Every session of every history length once; the histories run one after another,
        each beside the workload's decoding sessions."""
        workload = self.workload
        async with self._clients(target) as (clients, http):
            probe = DecodeMemoryProbe(target.metrics_urls, http)
            transfers = {
                "prefill": TransferProbe(target.prefill_metrics_urls, http),
                "decode": TransferProbe(target.metrics_urls, http),
            }
            records = RunRecords([], [], [])
            for history in workload.history_tokens:
                plans = [
                    SessionPlan(index, history, 0.0, tuple(workload.tool_latencies(history, index)))
                    for index in range(workload.sessions)
                ]
                origin = time.perf_counter()  # one clock for the turns and the decoders' chunks
                sessions = functools.partial(
                    self._sessions, clients, probe, target, repeat, plans, salt, None, origin
                )
                decoders = self._decoders(clients, target, repeat, history, origin)
                before = {role: await p.sample() for role, p in transfers.items()}
                turns, decoded = await run_beside(decoders, sessions)
                for role, transfer_probe in transfers.items():
                    after = await transfer_probe.sample()
                    if after is not None and (earlier := before[role]) is not None:
                        moved = after - earlier
                        records.transfers.append(
                            TransferRecord(
                                target.mode, repeat, history, role, moved.reads, moved.seconds
                            )
                        )
                records.turns.extend(turns)
                records.decodes.extend(decoded)
            return records

    async def run_plans(
        self, target: Target, repeat: int, salt: str, plans: Sequence[SessionPlan]
    ) -> list[TurnRecord]:
        """The given sessions, all at once (the pressure sweep's run of ``len(plans)``
        sessions); each record names that count in ``pressure_sessions``."""
        async with self._clients(target) as (clients, http):
            probe = DecodeMemoryProbe(target.metrics_urls, http)
            return await self._sessions(clients, probe, target, repeat, plans, salt, len(plans))

    @contextlib.asynccontextmanager
    async def _clients(
        self, target: Target
    ) -> AsyncIterator[tuple[dict[str, agentkv.AsyncOpenAI], httpx.AsyncClient]]:
        """One SDK client per endpoint over one connection pool, and that pool."""
        workload = self.workload
        limits = httpx.Limits(max_connections=workload.concurrency + workload.decoders + 4)
        async with httpx.AsyncClient(limits=limits, timeout=self.request_timeout_s) as http:
            yield (
                {
                    url: agentkv.AsyncOpenAI(
                        base_url=url.rstrip("/") + "/v1",
                        api_key="agentkv-bench",
                        max_retries=0,  # a retried turn would hide its failure in its latency
                        http_client=http,
                        agentkv_body=target.tag_body,
                    )
                    for url in target.base_urls
                },
                http,
            )

    async def _sessions(
        self,
        clients: dict[str, agentkv.AsyncOpenAI],
        probe: DecodeMemoryProbe,
        target: Target,
        repeat: int,
        plans: Sequence[SessionPlan],
        salt: str,
        pressure_sessions: int | None,
        origin: float | None = None,
    ) -> list[TurnRecord]:
        """The sessions of one run, at most ``concurrency`` at once; turn times count from
        ``origin`` (default: the run's start)."""
        slots = asyncio.Semaphore(max(self.workload.concurrency, pressure_sessions or 0))
        started = time.perf_counter() if origin is None else origin
        run = _Run(target, repeat, salt, started, pressure_sessions)
        by_session = await asyncio.gather(
            *(self._session(clients, probe, slots, run, plan) for plan in plans)
        )
        return [record for records in by_session for record in records]

    def _decoders(
        self,
        clients: dict[str, agentkv.AsyncOpenAI],
        target: Target,
        repeat: int,
        history: int,
        origin: float,
    ) -> list[DecodingSession]:
        return [
            DecodingSession(
                self.workload,
                self.tokenizer,
                clients[target.url_for(f"decoder-{index}")],
                target.model,
                DecodeRecord(target.mode, repeat, history, index, request=0),
                origin,
            )
            for index in range(self.workload.decoders)
        ]

    async def _session(
        self,
        clients: dict[str, agentkv.AsyncOpenAI],
        probe: DecodeMemoryProbe,
        slots: asyncio.Semaphore,
        run: _Run,
        plan: SessionPlan,
    ) -> list[TurnRecord]:
        workload, target = self.workload, run.target
        history, index = plan.history_tokens, plan.index
        session_id = session_name(run.salt, target.mode, run.repeat, plan, run.pressure_sessions)
        client = clients[target.url_for(session_id)]
        # The salt names the mode and repeat: with greedy sampling every mode would otherwise
        # send the same conversations, and an engine's prefix cache would serve a later mode
        # what an earlier one computed.
        system = workload.history_text(self.tokenizer, history, index, f"{run.salt} {session_id}")
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        waits = [plan.start_s, *plan.gaps_s]
        records: list[TurnRecord] = []
        async with slots, agentkv.session(session_id) as session:
            for turn, wait in enumerate(waits, start=1):
                if wait:
                    await asyncio.sleep(wait)
                    if turn > 1:
                        session.record_tool_time(wait)
                if turn == plan.turns and plan.ends and target.ends_sessions:
                    session.end_next_turn()
                new = workload.new_text(self.tokenizer, history, index, turn)
                messages.append({"role": "user", "content": new})
                where = _Turn(run, history, index, turn, wait if turn > 1 else 0.0)
                record, answer = await self._turn(client, target, session, messages, where)
                record = await _with_memory(record, probe)
                records.append(record)
                self._on_turn(record)
                if not record.ok:
                    break  # the conversation cannot go on without this turn's answer
                messages.append({"role": "assistant", "content": answer})
        return records

    async def _turn(
        self,
        client: agentkv.AsyncOpenAI,
        target: Target,
        session: agentkv.Session,
        messages: Sequence[dict[str, Any]],
        where: _Turn,
    ) -> tuple[TurnRecord, str]:
        base = TurnRecord(
            mode=target.mode,
            repeat=where.run.repeat,
            history_tokens=where.history,
            session=where.session,
            turn=where.turn,
            tool_latency_s=where.tool_latency_s,
            pressure_sessions=where.run.pressure_sessions,
        )
        return await stream_turn(
            client, target.model, session, messages, self.workload.output_tokens, base,
            where.run.started,
        )  # fmt: skip


async def stream_turn(
    client: agentkv.AsyncOpenAI,
    model: str,
    session: agentkv.Session,
    messages: Sequence[dict[str, Any]],
    output_tokens: int,
    base: TurnRecord,
    origin: float,
) -> tuple[TurnRecord, str]:
    """Send one streamed turn of exactly ``output_tokens`` inside ``session``; its record (``base``
    filled in, times from ``origin``, a ``perf_counter`` reading) and the answer's text. The TTFT
    runs from the call, so it includes whatever retries the client made before an answer."""
    started = time.perf_counter()
    base = replace(base, sent_s=started - origin)
    first: float | None = None
    last: float | None = None
    parts: list[str] = []
    usage: Any = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=list(messages),  # type: ignore[arg-type]
            max_tokens=output_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={**_EXACT_LENGTH, "min_tokens": output_tokens},
        )
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter()
            parts.extend(c.delta.content for c in chunk.choices if c.delta and c.delta.content)
            usage = chunk.usage or usage
            last = time.perf_counter()
    except (openai.OpenAIError, httpx.HTTPError, asyncio.TimeoutError) as exc:
        return replace(base, error=f"{type(exc).__name__}: {exc}"[:500]), ""
    ended = time.perf_counter()
    if first is None:
        return replace(base, error="stream ended without a chunk"), ""
    info = session.last_turn
    timing = info.server_timing if info else {}
    return (
        replace(
            base,
            ttft_s=first - started,
            latency_s=ended - started,
            prompt_tokens=getattr(usage, "prompt_tokens", None),
            output_tokens=getattr(usage, "completion_tokens", None),
            reused_tokens=_reused(info, usage),
            kv_path=info.kv_path if info else None,
            kv_reason=info.kv_reason if info else None,
            plan_s=timing.get("plan"),
            prefill_s=timing.get("prefill"),
            decode_s=timing.get("decode"),
            end_wait_s=ended - (last or ended),
            ended_s=ended - origin,
        ),
        "".join(parts),
    )


def session_name(
    salt: str, mode: str, repeat: int, plan: SessionPlan, pressure_sessions: int | None = None
) -> str:
    """The session id a run gives a session: unique per run, mode, repeat and sweep point."""
    point = "" if pressure_sessions is None else f"-n{pressure_sessions}"
    return f"bench-{salt}-{mode}-r{repeat}{point}-h{plan.history_tokens}-s{plan.index}"


def _reused(info: agentkv.TurnInfo | None, usage: Any) -> int | None:
    """The router's figure when there is a router, else the engine's prefix-cache hits."""
    if info is not None and info.reused_tokens is not None:
        return info.reused_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None)


async def _with_memory(record: TurnRecord, probe: DecodeMemoryProbe) -> TurnRecord:
    usage = await probe.sample()
    if usage is None:
        return record
    return replace(record, decode_kv_usage=usage.fraction, decode_kv_tokens=usage.tokens)
