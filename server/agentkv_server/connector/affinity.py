"""Where a worker's threads run: its own cores kept, the threads NIXL starts demoted."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator

from agentkv_server.connector.log import get_logger

__all__ = ["demote_to_idle_priority", "native_threads_started", "preserved_thread_affinity"]

logger = get_logger(__name__)


@contextlib.contextmanager
def preserved_thread_affinity() -> Iterator[None]:
    """Restore the calling thread's CPU affinity when the block exits.

    ``os.sched_setaffinity(0, ...)`` pins only the calling thread on Linux, so the restore
    touches nothing but the thread that entered the block; threads started inside it keep
    whatever affinity they inherited.
    """
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    saved = os.sched_getaffinity(0)
    try:
        yield
    finally:
        if os.sched_getaffinity(0) != saved:
            logger.info("Restoring the thread's CPU affinity to cores %s", sorted(saved))
            os.sched_setaffinity(0, saved)


@contextlib.contextmanager
def native_threads_started() -> Iterator[list[int]]:
    """Yield a list that, when the block exits, holds the ids of the threads native code
    started inside it (Python threads are left out). Empty where /proc is not available."""
    started: list[int] = []
    before = _thread_ids()
    try:
        yield started
    finally:
        python = {thread.native_id for thread in threading.enumerate()}
        started.extend(sorted(_thread_ids() - before - python))


def demote_to_idle_priority(thread_ids: Iterable[int]) -> list[int]:
    """Move threads to ``SCHED_IDLE``: they run only on a core nothing else wants.

    NIXL's progress thread, where it still polls without pause (``pthrDelay=0``, see
    ``progress.py``), then polls on idle cores only and never takes a core from a forward
    pass. Returns the threads demoted.
    """
    if not hasattr(os, "SCHED_IDLE"):
        return []
    demoted = []
    for thread_id in thread_ids:
        try:
            os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
        except (ProcessLookupError, PermissionError):  # gone already, or not ours to change
            continue
        demoted.append(thread_id)
    return demoted


def _thread_ids() -> set[int]:
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()
