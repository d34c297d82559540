"""The clairvoyant on hand-made traces whose optimum is known, and against exhaustive search."""

from __future__ import annotations

import itertools
import random

import pytest

from agentkv_server.bench.clairvoyant import TraceTurn, best_reuse, trace_of
from agentkv_server.bench.records import TurnRecord


def turn(session: str, index: int, start: float, end: float, tokens: int = 1) -> TraceTurn:
    return TraceTurn(session, index, start, end, tokens, prompt_tokens=tokens)


def test_everything_held_when_it_fits() -> None:
    trace = [turn("a", 1, 0, 1), turn("a", 2, 2, 3), turn("b", 1, 0, 1), turn("b", 2, 5, 6)]
    found = best_reuse(trace, capacity_tokens=2)
    assert (found.followups, found.reused, found.share) == (2, 2, 1.0)


def test_turns_being_served_push_holdings_out() -> None:
    """B's first turn needs the memory A's holding takes: A's follow-up cannot be reused."""
    trace = [
        turn("a", 1, 0, 1, 60), turn("a", 2, 10, 11, 60),
        turn("b", 1, 2, 3, 60), turn("b", 2, 5, 6, 60),
    ]  # fmt: skip
    found = best_reuse(trace, capacity_tokens=100)
    assert (found.followups, found.reused) == (2, 1)


def test_the_holding_used_furthest_away_is_dropped() -> None:
    """A and B finish together; one block stays free beside C's turn. B comes back first, so
    B's holding is kept: its 80 tokens are the ones reused."""
    trace = [
        turn("a", 1, 0, 1, 90), turn("a", 2, 10, 11, 90),
        turn("b", 1, 0, 1, 80), turn("b", 2, 5, 6, 80),
        turn("c", 1, 2, 3, 100),
    ]  # fmt: skip
    found = best_reuse(trace, capacity_tokens=200, block_size=100)
    assert (found.reused, found.reused_tokens) == (1, 80)


def test_a_long_idle_holding_gives_way_to_sessions_that_come_back_soon() -> None:
    """Keeping B (back at 50 s) would block every other reuse; the optimum, 3 of 4, drops it."""
    trace = [
        turn("a", 1, 0, 1), turn("a", 2, 2, 3), turn("a", 3, 4, 5),
        turn("b", 1, 0, 1), turn("b", 2, 50, 51),
        turn("c", 1, 1.5, 2.5), turn("c", 2, 3.5, 4.5),
    ]  # fmt: skip
    found = best_reuse(trace, capacity_tokens=2)
    assert (found.followups, found.reused) == (4, 3)


def test_a_session_that_goes_idle_holds_nothing() -> None:
    """An idle session's last turn has no next use: it never takes memory from the others."""
    trace = [turn("idle", 1, 0, 1), turn("a", 1, 0, 1), turn("a", 2, 3, 4)]
    assert best_reuse(trace, capacity_tokens=1).reused == 1


def test_memory_is_counted_in_whole_blocks() -> None:
    """Two 50-token holdings fit in 100 tokens, not in six 16-token blocks (four blocks each)."""
    trace = [turn("a", 1, 0, 1, 50), turn("a", 2, 3, 4, 50), turn("b", 1, 0, 1, 50),
             turn("b", 2, 3, 4, 50)]  # fmt: skip
    assert best_reuse(trace, capacity_tokens=100).reused == 2
    assert best_reuse(trace, capacity_tokens=100, block_size=16).reused == 1


def _exhaustive(trace: list[TraceTurn], capacity: int) -> int:
    """The most holdings of one block each that can be kept whole at once, by trying all."""
    holdings = [
        (t.end_s, n.start_s)
        for t in trace
        for n in trace
        if n.session == t.session and n.turn == t.turn + 1
    ]
    instants = sorted({t.start_s for t in trace} | {t.end_s for t in trace})
    best = 0
    for size in range(len(holdings), 0, -1):
        for kept in itertools.combinations(holdings, size):
            if all(_fits(trace, kept, at, capacity) for at in instants):
                return size
    return best


def _fits(
    trace: list[TraceTurn], kept: tuple[tuple[float, float], ...], at: float, cap: int
) -> bool:
    # At a turn's start its holding becomes the served turn; a holding starts at its turn's end.
    active = sum(1 for t in trace if t.start_s <= at < t.end_s)
    held = sum(1 for start, end in kept if start <= at < end)
    return held == 0 or active + held <= cap


def _random_trace(rng: random.Random) -> list[TraceTurn]:
    trace = []
    for session in range(rng.randint(2, 4)):
        clock = rng.uniform(0, 3)
        for index in range(1, rng.randint(2, 4) + 1):
            served = rng.uniform(0.5, 2)
            trace.append(turn(f"s{session}", index, clock, clock + served))
            clock += served + rng.uniform(0.1, 6)
    return trace


@pytest.mark.parametrize("seed", range(40))
def test_belady_is_the_optimum_for_holdings_of_one_size(seed: int) -> None:
    rng = random.Random(seed)
    trace = _random_trace(rng)
    capacity = rng.randint(1, 4)
    assert best_reuse(trace, capacity).reused == _exhaustive(trace, capacity)


def test_trace_of_records_starts_at_the_first_token_and_skips_failed_turns() -> None:
    base = TurnRecord("agentkv", 0, 2000, 1, 2, 1.0, sent_s=10.0, ended_s=13.0)
    answered = TurnRecord(**{**base.__dict__, "ttft_s": 0.5, "prompt_tokens": 100,
                             "output_tokens": 8})  # fmt: skip
    failed = TurnRecord(**{**base.__dict__, "turn": 3, "error": "boom"})
    (only,) = trace_of([answered, failed])
    assert (only.session, only.turn, only.start_s, only.end_s) == ("2000:1", 2, 10.5, 13.0)
    assert (only.tokens, only.prompt_tokens) == (108, 100)
