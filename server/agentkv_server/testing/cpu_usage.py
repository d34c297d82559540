"""How much CPU a process group uses, read from /proc (Linux), with the threads that used it;
and which of its processes still live.

Engines lead their own process groups (``ManagedProcess``), so a group is an engine's whole
process tree: API server, EngineCore and worker. The idle-CPU test
(tests/engine/test_idle_cpu.py) samples it twice and divides by the time between.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GroupCpu",
    "ThreadKey",
    "group_thread_cpu_seconds",
    "live_group_members",
    "sample_group_cpu",
]

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")

# (process id, thread id, thread name)
ThreadKey = tuple[int, int, str]


@dataclass(frozen=True)
class GroupCpu:
    """One process group's CPU use over a window: in cores (1.0 = one core busy throughout),
    and per thread, busiest first."""

    cores: float
    threads: list[tuple[ThreadKey, float]]

    def busiest(self, count: int = 5) -> str:
        """The ``count`` busiest threads, as ``name(pid/tid) 0.42`` items."""
        return ", ".join(
            f"{name}({pid}/{tid}) {cores:.3f}" for (pid, tid, name), cores in self.threads[:count]
        )


def group_thread_cpu_seconds(pgid: int) -> dict[ThreadKey, float]:
    """User + system CPU seconds so far of every thread of every process in group ``pgid``."""
    seconds: dict[ThreadKey, float] = {}
    for process in _PROC.glob("[0-9]*"):
        fields = _stat_fields(process / "stat")
        if fields is None or int(fields[2]) != pgid:  # fields[2]: the process group
            continue
        for task in process.glob("task/[0-9]*"):
            name = _comm(task / "comm")
            task_fields = _stat_fields(task / "stat")
            if task_fields is None:
                continue
            ticks = int(task_fields[11]) + int(task_fields[12])  # utime + stime
            seconds[(int(process.name), int(task.name), name)] = ticks / _TICKS_PER_SECOND
    return seconds


def live_group_members(pgid: int) -> list[int]:
    """The pids of group ``pgid``'s processes that have not exited. Unlike ``killpg(pgid, 0)``
    this leaves out zombies: an orphan's zombie lasts until init reaps it, and holds no memory
    or port."""
    members = []
    for process in _PROC.glob("[0-9]*"):
        fields = _stat_fields(process / "stat")
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(process.name))  # fields[0]: the state; Z zombie, X dead
    return members


def sample_group_cpu(pgids: Mapping[str, int], window: float) -> dict[str, GroupCpu]:
    """Each named group's CPU use over the next ``window`` seconds (sleeps that long)."""
    before = {name: group_thread_cpu_seconds(pgid) for name, pgid in pgids.items()}
    began = time.monotonic()
    time.sleep(window)
    after = {name: group_thread_cpu_seconds(pgid) for name, pgid in pgids.items()}
    elapsed = time.monotonic() - began
    return {name: _usage(before[name], after[name], elapsed) for name in pgids}


def _usage(
    before: Mapping[ThreadKey, float], after: Mapping[ThreadKey, float], elapsed: float
) -> GroupCpu:
    # A thread that ended inside the window is missed; one that started counts from zero.
    used = {key: (seconds - before.get(key, 0.0)) / elapsed for key, seconds in after.items()}
    threads = sorted(used.items(), key=lambda item: item[1], reverse=True)
    return GroupCpu(cores=sum(used.values()), threads=threads)


def _stat_fields(path: Path) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (field 3 onwards), or None if the
    process is gone. The name is in parentheses and may itself hold spaces or parentheses."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _comm(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"
