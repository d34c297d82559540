import asyncio
import dataclasses
import threading

import pytest

import agentkv
from agentkv.protocol import is_valid_session_id


def test_random_id_is_valid_and_unique():
    first, second = agentkv.session(), agentkv.session()
    assert is_valid_session_id(first.id)
    assert first.id != second.id


@pytest.mark.parametrize("bad_id", ["", "has space", "x" * 129, "semi;colon", 42])
def test_invalid_ids_are_refused(bad_id):
    with pytest.raises(agentkv.SessionError):
        agentkv.session(bad_id)


def test_negative_times_are_refused():
    with pytest.raises(agentkv.SessionError):
        agentkv.session(next_turn_seconds=-1)
    with pytest.raises(agentkv.SessionError):
        agentkv.session().record_tool_time(-0.5)


def test_with_sets_and_restores_the_current_session():
    assert agentkv.current_session() is None
    with agentkv.session("outer") as outer:
        assert agentkv.current_session() is outer
        with agentkv.session("inner") as inner:
            assert agentkv.current_session() is inner
        assert agentkv.current_session() is outer
    assert agentkv.current_session() is None


def test_a_session_can_be_re_entered():
    s = agentkv.session()
    with s:
        pass
    with s:
        assert agentkv.current_session() is s


def test_exit_without_enter_is_an_error():
    with pytest.raises(agentkv.SessionError):
        agentkv.session().__exit__(None, None, None)


async def test_async_with():
    async with agentkv.session("a") as s:
        assert agentkv.current_session() is s
    assert agentkv.current_session() is None


async def test_tasks_keep_their_own_sessions():
    seen = {}
    both_entered = asyncio.Barrier(2)

    async def run(name):
        async with agentkv.session(name):
            await both_entered.wait()
            seen[name] = agentkv.current_session().id

    await asyncio.gather(run("a"), run("b"))
    assert seen == {"a": "a", "b": "b"}


def test_threads_keep_their_own_sessions():
    seen = {}
    both_entered = threading.Barrier(2)

    def run(name):
        with agentkv.session(name):
            both_entered.wait()
            seen[name] = agentkv.current_session().id

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"a": "a", "b": "b"}


def test_decorator_runs_each_call_in_a_new_session():
    @agentkv.session()
    def agent():
        return agentkv.current_session()

    first, second = agent(), agent()
    assert first is not None and second is not None
    assert first.id != second.id
    assert agentkv.current_session() is None


async def test_decorator_on_a_coroutine_function():
    @agentkv.session("fixed-id")
    async def agent(x):
        await asyncio.sleep(0)
        return agentkv.current_session().id, x

    assert await agent(1) == ("fixed-id", 1)
    assert agentkv.current_session() is None


def test_turn_info_is_frozen():
    info = agentkv.TurnInfo(1, False, False, "reuse", 3, 0.1, "stop")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.turn = 2


def test_seeded_prediction_and_tool_time():
    s = agentkv.session(next_turn_seconds=4.0)
    assert s.predicted_next_turn_seconds == 4.0
    s.record_tool_time(2.0)
    assert s.predicted_next_turn_seconds == 3.0
