"""A server process that dies with its launcher, whatever killed the launcher.

A launcher that exits normally (or on SIGTERM, SIGINT) stops its servers itself
(``ManagedProcess.stop``). One that is SIGKILLed (``timeout -s KILL``, the OOM killer, a CI
runner's kill) cannot, and each engine it started ran on as an orphan, holding ~3 GB and its
ports, forever. So a tethered server runs as::

    python -m agentkv_server.bundle.tether LAUNCHER_PID -m MODULE ARGS...

(``ManagedProcess(..., dies_with_launcher=True)`` builds that command.)

A daemon thread watches the launcher (a pidfd: woken the moment it exits; where there is none,
its parent pid polled), then MODULE runs in this same process as ``python -m MODULE ARGS...``
would. Once the launcher is gone the thread SIGTERMs this process's group, as ``stop`` would,
and SIGKILLs it ``GRACE_S`` later; a member still there when this process exits normally is
SIGKILLed at its exit. The watch begins before MODULE is imported, so it covers the whole
start-up. The alternatives, and why not (docs/faults.md, "The launcher is killed"):

- ``prctl(PR_SET_PDEATHSIG)`` fires when the launcher *thread* that forked the server exits,
  and stacks are started from worker threads (``asyncio.to_thread``); it also needs a
  ``preexec_fn``, which is unsafe in a threaded launcher.
- A vLLM general plugin runs only where its entry point is installed and ``VLLM_PLUGINS``
  allows it, and would have to tell vLLM's top process from its EngineCore and workers.
- A supervisor process of our own between launcher and server: one more process per server.
"""

from __future__ import annotations

import atexit
import os
import runpy
import select
import signal
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["GRACE_S", "main", "wait_for_exit", "watch"]

# SIGTERM to SIGKILL: a vLLM engine's group (API server, EngineCore, worker) is gone in a few
# seconds after SIGTERM (docs/faults.md); this bounds one that hangs in its shutdown.
GRACE_S = 5.0
_POLL_S = 0.5  # only where there is no pidfd
_USAGE = "usage: python -m agentkv_server.bundle.tether LAUNCHER_PID -m MODULE [ARGS...]"


def watch(launcher_pid: int, grace_s: float = GRACE_S) -> threading.Thread:
    """Start a daemon thread that stops this process's group once ``launcher_pid`` (this
    process's parent) has exited; at once if it already has."""
    thread = threading.Thread(
        target=_stop_group_after, args=(launcher_pid, grace_s), name="agentkv-tether", daemon=True
    )
    thread.start()
    return thread


def wait_for_exit(parent_pid: int) -> None:
    """Return once ``parent_pid``, this process's parent, has exited."""
    try:
        pidfd: int | None = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd_open (not Linux, or a kernel before 5.3)
        pidfd = None
    try:
        # After pidfd_open: a parent that died in between shows here, not as a reused pid.
        if os.getppid() != parent_pid:
            return
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
            return
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _stop_group_after(launcher_pid: int, grace_s: float) -> None:
    wait_for_exit(launcher_pid)
    print(
        f"agentkv: launcher {launcher_pid} is gone; stopping this server's process group",
        file=sys.stderr,
        flush=True,
    )
    # A member that outlives this process (its shutdown left it behind) would run on unwatched.
    atexit.register(_signal_own_group, signal.SIGKILL)
    _signal_own_group(signal.SIGTERM)
    time.sleep(grace_s)
    _signal_own_group(signal.SIGKILL)


def _signal_own_group(sig: signal.Signals) -> None:
    """Signal this process's group if it leads one (``ManagedProcess`` starts it so), else only
    this process: a group shared with others is not ours to stop."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), sig)
    else:
        os.kill(os.getpid(), sig)


def main(argv: Sequence[str] | None = None) -> None:
    """``LAUNCHER_PID -m MODULE ARGS...``: watch the launcher, then run MODULE as ``__main__``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "-m" or not args[0].isdigit():
        raise SystemExit(_USAGE)
    launcher_pid, module, module_args = int(args[0]), args[2], args[3:]
    watch(launcher_pid)
    sys.argv = [module, *module_args]  # run_module sets argv[0] to the module's file
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
