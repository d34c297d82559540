"""Many agent sessions at once against a router in front of stub engines, every answer checked.

Each session is an agent loop: turn ``t`` sends the history of turns ``1..t`` (a system prompt,
then user/assistant messages), so every turn extends the previous one and may reuse its KV.
``concurrency`` workers each run one session's turns in order, then take the next session.
Sessions are never ended: like agents that simply stop, they leave their holdings to the
router's bounded index to evict.

A turn is *correct* when it is answered 200 with exactly what a stub engine generates for that
prompt (the same words, the prompt's token count, the session echoed back): nothing lost,
nothing crossed between sessions. The transport is the caller's (``Send``), so the same
workload drives an in-process app in unit tests and a router process in the load test.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.testing.harness import conversation
from agentkv_server.testing.stub_engine import count_prompt_tokens, stub_answer

__all__ = ["Send", "TurnOutcome", "WorkloadReport", "run_sessions"]

Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Mapping[str, str], Any]]]
"""``send(session_id, body) -> (status, headers, parsed JSON or None)``: one chat turn."""


@dataclass(frozen=True)
class TurnOutcome:
    session: str
    turn: int
    status: int
    correct: bool
    path: str | None
    reused_tokens: int
    seconds: float


@dataclass
class WorkloadReport:
    outcomes: list[TurnOutcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def succeeded(self) -> int:
        return sum(outcome.status == 200 for outcome in self.outcomes)

    @property
    def correct(self) -> int:
        return sum(outcome.correct for outcome in self.outcomes)

    def paths(self) -> Counter[str | None]:
        return Counter(outcome.path for outcome in self.outcomes)

    def percentile_ms(self, q: int) -> float:
        """The ``q``-th percentile of turn latency, in milliseconds."""
        seconds = [outcome.seconds for outcome in self.outcomes]
        if len(seconds) < 2:
            return 1000 * (seconds[0] if seconds else 0.0)
        return 1000 * statistics.quantiles(seconds, n=100)[q - 1]


async def run_sessions(
    send: Send,
    *,
    sessions: int,
    turns: int,
    concurrency: int,
    model: str = "stub-model",
    max_tokens: int = 4,
    history_words: Callable[[int], int] = lambda index: 200 + 100 * (index % 5),
    after_turn: Callable[[], Awaitable[None]] | None = None,
) -> WorkloadReport:
    """Run ``sessions`` sessions of ``turns`` turns with ``concurrency`` workers."""
    report = WorkloadReport()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(sessions):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            session = f"load-{index}"
            for turn in range(1, turns + 1):
                body = {
                    "model": model,
                    "messages": conversation(turn, history_words(index)),
                    "max_tokens": max_tokens,
                }
                report.outcomes.append(await _turn(send, session, turn, body))
                if after_turn is not None:
                    await after_turn()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.seconds = time.perf_counter() - began
    return report


async def _turn(send: Send, session: str, turn: int, body: dict[str, Any]) -> TurnOutcome:
    began = time.perf_counter()
    status, headers, answer = await send(session, body)
    seconds = time.perf_counter() - began
    return TurnOutcome(
        session=session,
        turn=turn,
        status=status,
        correct=status == 200 and _is_correct(answer, headers, session, body),
        path=headers.get(protocol.HEADER_KV_PATH),
        reused_tokens=int(headers.get(protocol.HEADER_REUSED_TOKENS) or 0),
        seconds=seconds,
    )


def _is_correct(answer: Any, headers: Mapping[str, str], session: str, body: dict) -> bool:
    try:
        content = answer["choices"][0]["message"]["content"]
        prompt_tokens = answer["usage"]["prompt_tokens"]
    except (KeyError, IndexError, TypeError):
        return False
    return (
        content == stub_answer(body["max_tokens"])
        and prompt_tokens == count_prompt_tokens(body)
        and headers.get(protocol.HEADER_RESPONSE_SESSION_ID) == session
        and wire.KV_TRANSFER_PARAMS not in answer
    )
