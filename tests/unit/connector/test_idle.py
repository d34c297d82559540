"""IdleBackoff: an engine loop that only waits is paced, one with work never is; long waits
end when a request arrives."""

from __future__ import annotations

import queue
import threading
import time

from agentkv_server.connector.idle import IdleBackoff, engine_input_queue, wait_for_input


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


def test_idle_waits_grow_fourfold_up_to_the_maximum() -> None:
    clock = FakeTime()
    idle = IdleBackoff(
        grace_seconds=0.1,
        sleep_seconds=0.005,
        max_wait_seconds=0.5,
        clock=lambda: clock.now,
        sleep=clock.sleep,
    )
    idle.step(busy=False)
    clock.now = 0.1
    for _ in range(6):
        idle.step(busy=False)
    assert clock.slept == [0.005, 0.02, 0.08, 0.32, 0.5, 0.5]
    idle.step(busy=True)  # work: the next idle stretch starts short again
    idle.step(busy=False)
    clock.now += 0.2
    idle.step(busy=False)
    assert clock.slept[-1] == 0.005


def test_without_a_maximum_the_wait_stays_at_the_sleep() -> None:
    clock = FakeTime()
    idle = backoff(clock)
    idle.step(busy=False)
    clock.now = 0.1
    for _ in range(5):
        idle.step(busy=False)
    assert clock.slept == [0.005] * 5


def test_wait_for_input_returns_when_a_request_arrives() -> None:
    requests: queue.Queue[str] = queue.Queue()
    threading.Timer(0.05, requests.put, args=("request",)).start()
    began = time.monotonic()
    wait_for_input(requests, 10.0)
    assert time.monotonic() - began < 5.0
    assert requests.get_nowait() == "request"


def test_wait_for_input_times_out_on_an_empty_queue() -> None:
    began = time.monotonic()
    wait_for_input(queue.Queue(), 0.05)
    assert time.monotonic() - began >= 0.05


def test_wait_for_input_does_not_wait_for_a_request_already_queued() -> None:
    requests: queue.Queue[str] = queue.Queue()
    requests.put("request")
    began = time.monotonic()
    wait_for_input(requests, 10.0)
    assert time.monotonic() - began < 5.0


class FakeEngineCore:
    """Builds its scheduler after its input queue, as vLLM's EngineCoreProc does."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[str] = queue.Queue()
        self.found = FakeScheduler().found


class FakeScheduler:
    def __init__(self) -> None:
        self.found = engine_input_queue()


def test_the_engine_cores_input_queue_is_found_from_its_scheduler() -> None:
    engine = FakeEngineCore()
    assert engine.found is engine.input_queue


def test_no_input_queue_outside_an_engine_core() -> None:
    assert FakeScheduler().found is None
