"""The router's queue for a busy engine: priority, fairness between tenants, predicted waits,
and turns that give up (router/queue.py)."""

from __future__ import annotations

import asyncio

import pytest

from agentkv_server.router.queue import Priority, QueuedStep, StepQueue

FOLLOW_UP, NEW = Priority.FOLLOW_UP, Priority.NEW
# One second of service per 1000 tokens until a step is served.
PRIOR = 1e-3


def holding_back(beyond_s: float = 0.0) -> StepQueue:
    return StepQueue(hold_beyond_s=beyond_s, prior_s_per_token=lambda: PRIOR)


async def sent_order(
    queue: StepQueue, turns: list[tuple[str, int, Priority, str | None]]
) -> list[str]:
    """Send ``turns`` (name, tokens, priority, tenant) in order while a first step occupies the
    engine, then end steps one by one; the names in the order the engine got them."""
    order: list[str] = []
    first = await queue.send(1000, NEW, None)

    async def turn(name: str, tokens: int, priority: Priority, tenant: str | None) -> None:
        step = await queue.send(tokens, priority, tenant)
        order.append(name)
        await asyncio.sleep(0)
        queue.ended(step)

    tasks = [asyncio.create_task(turn(*spec)) for spec in turns]
    await asyncio.sleep(0)  # every new session's turn held; follow-ups go beside the first
    assert queue.held_count(NEW) == sum(priority is NEW for _, _, priority, _ in turns)
    queue.ended(first)
    await asyncio.gather(*tasks)
    return order


async def test_a_free_engine_takes_a_step_at_once_and_a_busy_one_holds_the_next() -> None:
    queue = holding_back()
    first = await queue.send(500, NEW, None)
    assert first.waited_s == 0.0
    second = asyncio.create_task(queue.send(500, NEW, None))
    await asyncio.sleep(0.01)
    assert not second.done() and queue.held_count(NEW) == 1
    assert queue.held_s() == pytest.approx(0.5)

    queue.ended(first)
    step = await asyncio.wait_for(second, 1)
    assert step.waited_s > 0 and queue.held_count(NEW) == 0


async def test_follow_ups_go_first_then_tenants_take_turns() -> None:
    order = await sent_order(
        holding_back(),
        [
            ("a1", 500, NEW, "a"),
            ("a2", 500, NEW, "a"),
            ("a3", 500, NEW, "a"),
            ("b1", 500, NEW, "b"),
            ("f1", 200, FOLLOW_UP, "a"),
            ("b2", 500, NEW, "b"),
        ],
    )
    assert order == ["f1", "a1", "b1", "a2", "b2", "a3"]


async def test_a_tenant_with_large_turns_gets_fewer_of_them() -> None:
    """Fair by predicted service, not by count: two 1000-token turns weigh four 500-token."""
    order = await sent_order(
        holding_back(),
        [("big1", 1000, NEW, "big"), ("big2", 1000, NEW, "big")]
        + [(f"small{i}", 500, NEW, "small") for i in range(1, 5)],
    )
    assert order == ["big1", "small1", "small2", "big2", "small3", "small4"]


async def test_a_turns_predicted_wait_counts_what_goes_before_it() -> None:
    queue = holding_back()
    first = await queue.send(2000, NEW, None)  # 2 s at the prior rate
    held = [asyncio.create_task(queue.send(1000, NEW, "a")) for _ in range(3)]
    await asyncio.sleep(0)

    assert queue.wait_s(500, NEW, "a") == pytest.approx(5.0, abs=0.05)  # behind all of a's
    assert queue.wait_s(500, NEW, "b") == pytest.approx(3.0, abs=0.05)  # after a's first
    assert queue.wait_s(500, FOLLOW_UP, "a") == 0.0  # before them, beside the first
    queue.ended(first)
    for task in held:
        queue.ended(await task)


async def test_a_new_turns_wait_counts_the_follow_ups_that_will_go_before_it() -> None:
    """Follow-ups keep arriving and keep going first: a new session's turn waits for the work
    ahead of it stretched by their share of the engine, wait / (1 - share)."""
    queue = holding_back()
    for _ in range(3):  # 30 s of follow-ups in the last minute: half the engine
        queue.ended(await queue.send(10_000, FOLLOW_UP, "a"))
    first = await queue.send(2000, NEW, None)  # 2 s ahead of anything sent now

    assert queue.follow_up_share() == pytest.approx(0.5, abs=0.01)
    assert queue.wait_s(500, FOLLOW_UP, "a") == 0.0
    assert queue.wait_s(500, NEW, "b") == pytest.approx(4.0, abs=0.1)
    queue.ended(first)


async def test_an_engine_is_sent_work_while_its_work_ends_within_the_bound() -> None:
    queue = holding_back(beyond_s=1.5)
    steps = [await queue.send(1000, NEW, None) for _ in range(2)]  # 1 s, then 2 s of work
    third = asyncio.create_task(queue.send(1000, NEW, None))
    await asyncio.sleep(0.01)
    assert len(steps) == 2 and not third.done()  # 2 s of work: more than 1.5 s
    queue.ended(steps[0])
    queue.ended(await asyncio.wait_for(third, 1))
    queue.ended(steps[1])


async def test_a_held_turn_is_sent_when_the_work_in_flight_is_predicted_to_leave_room() -> None:
    """No step ends, but the oldest has been served long enough to be nearly done."""
    queue = holding_back(beyond_s=0.0)
    first = await queue.send(100, NEW, None)  # 0.1 s at the prior rate
    second = asyncio.create_task(queue.send(100, NEW, None))
    step = await asyncio.wait_for(second, 1)  # sent about 0.1 s later, the first still running
    assert 0.05 <= step.waited_s < 0.5
    queue.ended(first)
    queue.ended(step)


async def test_a_turn_that_gives_up_leaves_the_queue() -> None:
    queue = holding_back()
    first = await queue.send(1000, NEW, None)
    with pytest.raises(asyncio.TimeoutError):
        await queue.send(1000, NEW, None, timeout_s=0.05)
    cancelled = asyncio.create_task(queue.send(1000, NEW, "b"))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)

    assert queue.held_count(NEW) == 0
    queue.ended(first)
    assert queue.tokens_in_flight == 0  # nothing was sent for the turns that left
    assert (await queue.send(10, NEW, None)).waited_s == 0.0


async def test_a_follow_up_waits_for_follow_ups_not_for_new_sessions_prompts() -> None:
    """The engine computes a long prompt a slice at a time beside the others: a follow-up goes
    out at once beside new sessions' prompts, but waits behind other follow-ups."""
    queue = holding_back()
    cold = await queue.send(3000, NEW, None)
    beside = await asyncio.wait_for(queue.send(200, FOLLOW_UP, "a"), 0.1)
    behind = asyncio.create_task(queue.send(200, FOLLOW_UP, "b"))
    await asyncio.sleep(0.01)

    assert beside.waited_s == 0.0 and not behind.done()
    # The held follow-up only: in flight counts from the first served step (backlog_s's rule).
    assert queue.follow_up_backlog_s() == pytest.approx(0.2)
    queue.ended(beside)
    queue.ended(await asyncio.wait_for(behind, 1))
    queue.ended(cold)


async def test_a_queue_that_holds_nothing_back_sends_at_once() -> None:
    queue = StepQueue()  # decode engines, or admission off
    steps = [await queue.send(1000, NEW, None) for _ in range(5)]
    assert all(isinstance(step, QueuedStep) for step in steps)
    assert queue.tokens_in_flight == 5000 and queue.held_s() == 0.0
