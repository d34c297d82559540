"""The stall fix: a thread's own cores survive code that re-pins it."""

from __future__ import annotations

import os
import threading

import pytest

from agentkv_server.connector.affinity import preserved_thread_affinity

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux thread affinity and at least two usable cores",
)


def in_thread(body):  # type: ignore[no-untyped-def]
    """Run ``body`` in a fresh thread (so pytest's own thread is never re-pinned)."""
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.update(value=body()))
    thread.start()
    thread.join(10)
    return result["value"]


def test_affinity_is_restored_after_the_block_repins_the_thread() -> None:
    def body() -> tuple[set[int], set[int], set[int]]:
        own = os.sched_getaffinity(0)
        with preserved_thread_affinity():
            os.sched_setaffinity(0, {max(own)})  # what upstream's NIXL worker does
            inside = os.sched_getaffinity(0)
        return own, inside, os.sched_getaffinity(0)

    own, inside, after = in_thread(body)
    assert inside == {max(own)}
    assert after == own


def test_threads_started_inside_keep_the_reserved_core() -> None:
    def body() -> tuple[set[int], set[int]]:
        own = os.sched_getaffinity(0)
        child: dict[str, set[int]] = {}
        with preserved_thread_affinity():
            os.sched_setaffinity(0, {max(own)})
            started = threading.Event()
            release = threading.Event()

            def progress_thread() -> None:
                child["cores"] = os.sched_getaffinity(0)
                started.set()
                release.wait(10)

            thread = threading.Thread(target=progress_thread)
            thread.start()
            started.wait(10)
        release.set()
        thread.join(10)
        return own, child["cores"]

    own, child = in_thread(body)
    assert child == {max(own)}


def test_restored_even_when_the_block_raises() -> None:
    def body() -> tuple[set[int], set[int]]:
        own = os.sched_getaffinity(0)
        with pytest.raises(RuntimeError), preserved_thread_affinity():
            os.sched_setaffinity(0, {max(own)})
            raise RuntimeError("NIXL failed")
        return own, os.sched_getaffinity(0)

    own, after = in_thread(body)
    assert after == own
