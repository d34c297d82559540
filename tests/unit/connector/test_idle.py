"""IdleBackoff: an engine loop that only waits is paced, one with work never is."""

from __future__ import annotations

from agentkv_server.connector.idle import IdleBackoff


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def backoff(clock: FakeTime, sleep_seconds: float = 0.005) -> IdleBackoff:
    return IdleBackoff(
        grace_seconds=0.1, sleep_seconds=sleep_seconds, clock=lambda: clock.now, sleep=clock.sleep
    )


def test_idle_steps_sleep_only_after_the_grace_period() -> None:
    clock = FakeTime()
    idle = backoff(clock)
    assert idle.step(busy=False) == 0.0
    clock.now = 0.099
    assert idle.step(busy=False) == 0.0
    clock.now = 0.1
    assert idle.step(busy=False) == 0.005
    assert idle.step(busy=False) == 0.005
    assert clock.slept == [0.005, 0.005]


def test_a_busy_step_restarts_the_grace_period() -> None:
    clock = FakeTime()
    idle = backoff(clock)
    idle.step(busy=False)
    clock.now = 1.0
    assert idle.step(busy=True) == 0.0
    assert idle.step(busy=False) == 0.0
    clock.now = 1.05
    assert idle.step(busy=False) == 0.0
    assert clock.slept == []


def test_busy_steps_never_sleep() -> None:
    clock = FakeTime()
    idle = backoff(clock)
    for step in range(100):
        clock.now = step * 0.01
        assert idle.step(busy=True) == 0.0
    assert clock.slept == []


def test_zero_sleep_turns_it_off() -> None:
    clock = FakeTime()
    idle = backoff(clock, sleep_seconds=0.0)
    for step in range(100):
        clock.now = step * 0.01
        assert idle.step(busy=False) == 0.0
    assert clock.slept == []
