"""Decoding sessions: the concurrency dimension's long outputs, decoded beside the agent turns.

A turn that continues on its decode holder (``local``) prefills its new tokens on the engine
that decodes other sessions, and every sequence in that engine's batch waits for it; the same
holds for ``aggregated`` serving. Pulls and recomputes prefill on P instead. What that costs the
other sessions is their inter-token latency, so each decoding session streams long outputs, one
request after another, through the mode's endpoint and records the time between its chunks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import httpx
import openai

import agentkv
from agentkv_server.bench.records import DecodeRecord
from agentkv_server.bench.workload import TextTokenizer, Workload

__all__ = ["DecodingSession", "run_beside"]

T = TypeVar("T")

# Every request decodes exactly ``decode_tokens`` tokens (random-weight models stop early else).
_EXACT_LENGTH = {"ignore_eos": True}


class DecodingSession:
    """One decoding session of a mode's run at one history length.

    :meth:`run` sends long-output requests, one after another, until ``stop`` is set; it sets
    ``ready`` once its first request streams (the agent sessions start then, so that every
    turn meets a decoding batch) or has failed.
    """

    def __init__(
        self,
        workload: Workload,
        tokenizer: TextTokenizer,
        client: agentkv.AsyncOpenAI,
        model: str,
        base: DecodeRecord,
        origin: float,
    ) -> None:
        self._workload = workload
        self._origin = origin
        self._client = client
        self._model = model
        self._base = base
        salt = f"{base.mode} r{base.repeat} h{base.history_tokens}"
        self._prompt = workload.decoder_text(tokenizer, base.decoder, salt)
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> list[DecodeRecord]:
        records: list[DecodeRecord] = []
        try:
            while not stop.is_set():
                record = await self._request(replace(self._base, request=len(records)), stop)
                records.append(record)
                self.ready.set()
                if record.error is not None:
                    break  # a failing endpoint gets no more load; the error is in the records
        finally:
            self.ready.set()
        return records

    async def _request(self, base: DecodeRecord, stop: asyncio.Event) -> DecodeRecord:
        tokens = self._workload.decode_tokens
        started = time.perf_counter()
        base = replace(base, sent_s=started - self._origin)
        arrivals: list[float] = []
        try:
            stream = await self._client.chat.completions.create(
                model=self._model,
                messages=[{"role": "user", "content": self._prompt}],
                max_tokens=tokens,
                temperature=0.0,
                stream=True,
                extra_body={**_EXACT_LENGTH, "min_tokens": tokens},
            )
            async for chunk in stream:
                if any(c.delta and c.delta.content for c in chunk.choices):
                    arrivals.append(time.perf_counter())
                    self.ready.set()
                if stop.is_set():
                    await stream.close()  # cut: the agent sessions it ran beside are done
                    return _timed(base, started, arrivals, complete=False)
        except (openai.OpenAIError, httpx.HTTPError, asyncio.TimeoutError) as exc:
            failed = _timed(base, started, arrivals, complete=False)
            return replace(failed, error=f"{type(exc).__name__}: {exc}"[:500])
        if not arrivals:
            return replace(base, error="stream ended without a token")
        return _timed(base, started, arrivals, complete=True)


def _timed(
    base: DecodeRecord, started: float, arrivals: list[float], *, complete: bool
) -> DecodeRecord:
    gaps = tuple(later - earlier for earlier, later in itertools.pairwise(arrivals))
    ttft = arrivals[0] - started if arrivals else None
    return replace(base, ttft_s=ttft, gaps_s=gaps, complete=complete)


async def run_beside(
    decoders: list[DecodingSession], sessions: Callable[[], Awaitable[T]]
) -> tuple[T, list[DecodeRecord]]:
    """Run ``sessions()`` while ``decoders`` decode: they start first, and are cut when the
    sessions end. Returns the sessions' result and the decoders' records."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(decoder.run(stop)) for decoder in decoders]
    try:
        await asyncio.gather(*(decoder.ready.wait() for decoder in decoders))
        result = await sessions()
    finally:
        stop.set()
        decoded = await asyncio.gather(*tasks)
    return result, [record for records in decoded for record in records]
