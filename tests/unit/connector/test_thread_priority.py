"""NIXL's polling threads: the native threads a block starts are found and demoted."""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from agentkv_server.connector.affinity import demote_to_idle_priority, native_threads_started

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or not hasattr(os, "SCHED_IDLE"),
    reason="needs Linux /proc and SCHED_IDLE",
)


def test_native_threads_started_in_the_block_are_found_and_python_threads_are_not() -> None:
    release = threading.Event()
    python_thread = threading.Thread(target=release.wait, args=(10,))
    context = zmq.Context(io_threads=1)
    try:
        with native_threads_started() as started:
            python_thread.start()
            socket = context.socket(zmq.PAIR)  # zmq starts its I/O thread in C++ here
        assert started, "zmq's I/O thread was not found"
        assert python_thread.native_id not in started
        assert all(os.path.isdir(f"/proc/self/task/{tid}") for tid in started)
    finally:
        release.set()
        python_thread.join(10)
        socket.close()
        context.term()


def test_demoted_threads_run_at_idle_priority() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(10,))
    thread.start()
    try:
        assert thread.native_id is not None
        assert demote_to_idle_priority([thread.native_id, 2**22 + 12345]) == [thread.native_id]
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
    finally:
        release.set()
        thread.join(10)
