"""The one attempt loop that every step of a turn runs through (P, D, local, a stream's resume).

A scripted step stands in for the engines: what each try raises, and what the step makes of it.
The loop must note every failure, keep the engines the step excludes out of later picks, stop at
a refusal, and stop after ``tries``.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentkv_server.router.failures import ErrorKind
from agentkv_server.router.orchestrator.attempts import Attempt, Refused, Then, attempt
from agentkv_server.router.placement import Engine
from agentkv_server.router.upstream import EngineFailure


class Notes:
    """Stands in for Services: records what the loop notes."""

    def __init__(self) -> None:
        self.noted: list[tuple[str, ErrorKind, bool]] = []

    def note_failure(self, turn: object, failure: EngineFailure, *, stalled: bool = False) -> None:
        self.noted.append((failure.engine.url, failure.kind, stalled))


class Scripted(Attempt[str]):
    """Tries engines in order; each try raises the engine's next scripted failure, else
    serves its URL."""

    def __init__(
        self,
        engines: list[Engine],
        fails: dict[str, list[tuple[ErrorKind, int | None]]],
        then: dict[ErrorKind, Then],
    ) -> None:
        super().__init__(Notes(), None)  # type: ignore[arg-type]
        self.engines = engines
        self.fails = fails
        self.verdicts = then
        self.sent: list[str] = []

    @property
    def noted(self) -> list[tuple[str, ErrorKind, bool]]:
        return self.services.noted  # type: ignore[attr-defined,no-any-return]

    def pick(self, excluded: Sequence[Engine]) -> Engine | None:
        return next((engine for engine in self.engines if engine not in excluded), None)

    async def send(self, engine: Engine) -> str:
        self.sent.append(engine.url)
        if script := self.fails.get(engine.url):
            kind, status = script.pop(0)
            raise EngineFailure(engine, kind, "scripted", status=status)
        return engine.url

    def then(self, failure: EngineFailure) -> Then:
        return self.verdicts[failure.kind]

    def stalled(self, failure: EngineFailure) -> bool:
        return failure.kind == "stall"


def pool(n: int) -> list[Engine]:
    return [Engine(f"http://d{i}", "decode") for i in range(n)]


async def test_a_failed_engine_is_left_out_and_the_next_serves() -> None:
    step = Scripted(pool(3), {"http://d0": [("disconnect", None)]}, {"disconnect": Then.ELSEWHERE})
    assert await attempt(step, tries=2) == "http://d1"
    assert step.sent == ["http://d0", "http://d1"]
    assert step.noted == [("http://d0", "disconnect", False)]


async def test_again_lets_the_same_engine_take_the_next_try() -> None:
    step = Scripted(pool(2), {"http://d0": [("stall", None)]}, {"stall": Then.AGAIN})
    assert await attempt(step) == "http://d0"
    assert step.sent == ["http://d0", "http://d0"]
    assert step.noted == [("http://d0", "stall", True)]


async def test_a_refusal_ends_the_step_with_the_engines_answer() -> None:
    step = Scripted(pool(2), {"http://d0": [("status", 400)]}, {"status": Then.REFUSED})
    refused = await attempt(step, tries=2)
    assert isinstance(refused, Refused) and refused.failure.status == 400
    assert step.sent == ["http://d0"]


async def test_tries_bound_the_step_though_engines_are_left() -> None:
    fails: dict[str, list[tuple[ErrorKind, int | None]]] = {
        url: [("timeout", None)] for url in ("http://d0", "http://d1")
    }
    step = Scripted(pool(3), fails, {"timeout": Then.ELSEWHERE})
    assert await attempt(step, tries=2) is None
    assert step.sent == ["http://d0", "http://d1"]


async def test_no_engine_left_but_the_excluded_is_none() -> None:
    engines = pool(2)
    step = Scripted(engines, {"http://d1": [("connect", None)]}, {"connect": Then.ELSEWHERE})
    assert await attempt(step, excluded=[engines[0]]) is None
    assert step.sent == ["http://d1"]
