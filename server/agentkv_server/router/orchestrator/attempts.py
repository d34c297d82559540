"""The one loop that tries a step on engines until one serves it: P, D, local and resume.

Each step is an :class:`Attempt`: which engine to try next, what to send it, and what a failure
means for the next try. The loop notes every failure (the engine's blame, the metrics) and keeps
the engines that failed out of later picks.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from agentkv_server.router.orchestrator.services import Services
from agentkv_server.router.placement import Engine
from agentkv_server.router.turn import Turn
from agentkv_server.router.upstream import EngineFailure

__all__ = ["Attempt", "Refused", "Then", "attempt"]

T = TypeVar("T")


class Then(enum.Enum):
    """What a failed try means for the step."""

    REFUSED = "refused"
    """The engine refused the request itself: hand its answer back, try no other."""
    ELSEWHERE = "elsewhere"
    """Try another engine."""
    AGAIN = "again"
    """Try again; the engine that failed may take the next try."""


@dataclass(frozen=True)
class Refused:
    """A step's engine refused the request itself (a 4xx): another engine would refuse it too."""

    failure: EngineFailure


class Attempt(ABC, Generic[T]):
    """One step of a turn, as the attempt loop tries it (one or two per turn: slotted)."""

    __slots__ = ("services", "turn")

    def __init__(self, services: Services, turn: Turn) -> None:
        self.services = services
        self.turn = turn

    @abstractmethod
    def pick(self, excluded: Sequence[Engine]) -> Engine | None:
        """The engine for the next try, not one of ``excluded``; None when none is left."""

    @abstractmethod
    async def send(self, engine: Engine) -> T:
        """The step on ``engine``; EngineFailure when it did not serve it."""

    @abstractmethod
    def then(self, failure: EngineFailure) -> Then:
        """What ``failure`` (noted already) means for the next try."""

    def stalled(self, failure: EngineFailure) -> bool:
        """Whether ``failure`` is a pull that stalled on its source, which blames no engine."""
        return False


async def attempt(
    step: Attempt[T], *, tries: int | None = None, excluded: Iterable[Engine] = ()
) -> T | Refused | None:
    """``step`` served by the first engine that can, trying at most ``tries`` times (None: as
    long as ``step.pick`` finds an engine), never on ``excluded``; its refusal, or None when no
    engine served it. A step that ran out of the turn's time ends the turn (TurnTimedOut)."""
    failed = list(excluded)
    tried = 0
    while tries is None or tried < tries:
        tried += 1
        engine = step.pick(failed)
        if engine is None:
            return None
        try:
            return await step.send(engine)
        except EngineFailure as failure:
            step.services.note_failure(step.turn, failure, stalled=step.stalled(failure))
            if failure.kind == "deadline":
                raise step.services.turn_timed_out(step.turn, failure.engine.role) from None
            then = step.then(failure)
            if then is Then.REFUSED:
                return Refused(failure)
        if then is Then.ELSEWHERE:
            failed.append(engine)
    return None
