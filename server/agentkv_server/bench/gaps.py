"""What the decoding sessions' slow gaps ran beside: the agent turns' steps at that moment.

The TPOT p99 of a mode says how slow its worst gaps were, not why. Every gap has a place on the
run's clock (``DecodeRecord.sent_s``, the first chunk at ``ttft_s``, then the gaps in order),
and every routed turn its steps (``sent_s``, then ``plan_s``, ``prefill_s`` and ``decode_s`` from
the router's ``Server-Timing``). A slow gap is put beside each step it overlaps, so a tail that
comes from cold first turns on P (every mode has them) reads apart from one that comes from a
local prefill on the holder or a pull's read of it. Each step's count of all the gaps beside it
says how often a gap beside it was slow: a tail beside a step that runs all through the run
(``recompute on P`` in the recompute mode) is not that step's doing unless its share is higher
than elsewhere.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from agentkv_server.bench.records import DecodeRecord, TurnRecord

__all__ = ["GAP_STEPS", "SLOW_GAP_FACTOR", "GapCauses", "gap_causes"]

_Step = tuple[str, float, float]  # name, begin, end
_Gap = tuple[int, int, float, float]  # repeat, history tokens, begin, end

SLOW_GAP_FACTOR = 2.0
"""A gap is slow when it is over this many times its mode's median gap."""

ANSWER = "answer on D"
ANSWERS = "2+ answers on D"
GAP_STEPS = (
    "first turn on P",
    "local prefill",
    "pull on P",
    "recompute on P",
    "D after P",
    ANSWER,
    ANSWERS,
)
"""The steps a slow gap is put beside, in the report's order; ``none`` when it overlaps no
turn's step (a tool wait, or nothing of the agent sessions). A gap beside two or more answers
counts under both ``ANSWER`` and ``ANSWERS``."""


@dataclass(frozen=True)
class GapCauses:
    """One mode's slow gaps: how many, their seconds, and per step (GAP_STEPS or ``none``) the
    slow gaps that overlapped it and all the gaps that did; one gap may overlap several steps."""

    mode: str
    threshold_s: float
    slow: int
    slow_s: float
    by_step: dict[str, int]
    gaps_by_step: dict[str, int]


def gap_causes(turns: Sequence[TurnRecord], decodes: Sequence[DecodeRecord]) -> list[GapCauses]:
    """Per mode with timed decoding sessions, its slow gaps and the steps beside them."""
    steps: dict[tuple[str, int, int], list[_Step]] = defaultdict(list)
    for turn in turns:
        steps[(turn.mode, turn.repeat, turn.history_tokens)].extend(_steps(turn))
    gaps_by_mode: dict[str, list[_Gap]] = defaultdict(list)
    for record in decodes:
        for begin, end in _gap_spans(record):
            gaps_by_mode[record.mode].append((record.repeat, record.history_tokens, begin, end))
    return [_causes(mode, gaps, steps) for mode, gaps in gaps_by_mode.items() if len(gaps) > 1]


def _causes(
    mode: str, gaps: Sequence[_Gap], steps: dict[tuple[str, int, int], list[_Step]]
) -> GapCauses:
    threshold = SLOW_GAP_FACTOR * statistics.median(end - begin for *_, begin, end in gaps)
    by_step: dict[str, int] = defaultdict(int)
    gaps_by_step: dict[str, int] = defaultdict(int)
    slow = 0
    slow_s = 0.0
    for repeat, history, begin, end in gaps:
        overlapped = [
            name for name, a, b in steps[(mode, repeat, history)] if a < end and b > begin
        ]
        beside = set(overlapped)
        if overlapped.count(ANSWER) > 1:
            beside.add(ANSWERS)
        is_slow = end - begin > threshold
        slow += is_slow
        slow_s += (end - begin) * is_slow
        for name in beside or {"none"}:
            gaps_by_step[name] += 1
            by_step[name] += is_slow
    return GapCauses(mode, threshold, slow, slow_s, dict(by_step), dict(gaps_by_step))


def _gap_spans(record: DecodeRecord) -> Iterator[tuple[float, float]]:
    """Each gap as (begin, end) on the run's clock; none for a record without ``sent_s``."""
    if record.sent_s is None or record.ttft_s is None:
        return
    at = record.sent_s + record.ttft_s
    for gap in record.gaps_s:
        yield at, at + gap
        at += gap


def _steps(turn: TurnRecord) -> Iterable[_Step]:
    """A routed turn's steps on the run's clock; a turn the router did not time has none."""
    if not turn.ok or turn.sent_s is None or turn.plan_s is None or turn.ttft_s is None:
        return ()
    start = turn.sent_s + turn.plan_s
    first_byte = turn.sent_s + turn.ttft_s
    answer = () if turn.ended_s is None else ((ANSWER, first_byte, turn.ended_s),)
    if turn.kv_path == "local":
        return (("local prefill", start, first_byte), *answer)
    on_p = start + (turn.prefill_s or 0.0)
    name = "first turn on P" if turn.turn == 1 else _P_STEP.get(turn.kv_path or "", "")
    return ((name, start, on_p), ("D after P", on_p, first_byte), *answer) if name else ()


_P_STEP = {"reuse": "pull on P", "recompute": "recompute on P"}
