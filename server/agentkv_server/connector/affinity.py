"""Keeping a thread on its cores while code it calls re-pins it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from agentkv_server.connector.log import get_logger

__all__ = ["preserved_thread_affinity"]

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
