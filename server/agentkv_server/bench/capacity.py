"""What the stack serves, measured before the overload runs: the prompt tokens per second its
prefill engine computes for cold turns.

``calibration_turns`` one-turn sessions of the preset's mean initial history, each salted so
that no cache holds any of it, go one after another through a ``recompute`` router (the same
engines every mode uses). The capacity is their prompt tokens over the seconds of their prefill
steps (the router's ``Server-Timing`` ``prefill``; a turn without it counts its TTFT): the rate
of the engine that computes every cold turn and, in the modes with P/D engines, every prompt a
follow-up cannot reuse. One turn at a time, so the figure is the engine's rate, not a queue's;
the offered loads are multiples of it (bench/overload.py), the same for every mode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

from agentkv_server.bench.overload import OverloadWorkload
from agentkv_server.bench.pressure import SessionPlan
from agentkv_server.bench.runner import Runner, Target
from agentkv_server.errors import AgentKVServerError

__all__ = ["GIVEN", "Capacity", "measure_capacity"]

GIVEN: Final = "given with --capacity"
# Calibration sessions are numbered apart from the measured ones.
_FIRST_INDEX: Final = 900_000


@dataclass(frozen=True)
class Capacity:
    """Prompt tokens per second, how the figure came about, and each calibration turn's prompt
    tokens and prefill seconds (none where the figure was given)."""

    tokens_per_s: float
    method: str
    prompt_tokens: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0:
            raise AgentKVServerError(f"capacity: {self.tokens_per_s} tokens/s is no capacity")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Capacity:
        return cls(
            data["tokens_per_s"],
            data["method"],
            tuple(data.get("prompt_tokens", ())),
            tuple(data.get("seconds", ())),
        )


async def measure_capacity(
    target: Target, runner: Runner, workload: OverloadWorkload, salt: str
) -> Capacity:
    """Send the calibration turns through ``target`` (a ``recompute`` router) one at a time."""
    history = round(sum(workload.history_tokens) / 2)
    tokens: list[int] = []
    seconds: list[float] = []
    for index in range(workload.calibration_turns):
        plan = SessionPlan(_FIRST_INDEX + index, history, 0.0, ())
        (turn,) = await runner.run_plans(target, -1, f"calibrate-{salt}", [plan])
        step = turn.prefill_s if turn.prefill_s is not None else turn.ttft_s
        if not turn.ok or turn.prompt_tokens is None or not step:
            raise AgentKVServerError(f"capacity: a calibration turn failed ({turn.error})")
        tokens.append(turn.prompt_tokens)
        seconds.append(step)
    method = (
        f"{len(tokens)} cold turns of {history} tokens of history, one after another through a "
        f"recompute router: their prompt tokens over their prefill steps' seconds"
    )
    return Capacity(sum(tokens) / sum(seconds), method, tuple(tokens), tuple(seconds))
