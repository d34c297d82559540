"""A server process the bundle owns: started in its own process group, logged to a file, polled
until its health URL answers, and stopped with everything it forked.

vLLM forks an EngineCore and a worker process per engine; signalling only the process we
started would orphan them. Each managed process therefore leads a new session (its own
process group), and stopping it signals the whole group.

A process started ``dies_with_launcher`` also stops its group when the launcher is SIGKILLed
(``agentkv_server.bundle.tether``), so that nothing we start outlives us as an orphan.

A start that cannot succeed fails within a poll interval, not at the start timeout: when the
process exits, or when its log shows a fatal error (a port clash, an engine core that failed
to initialise) although the process lingers on (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from typing_extensions import Self

from agentkv_server.errors import EngineError, PortInUseError

__all__ = ["PORT_CLASH_MARKERS", "ManagedProcess", "log_tail"]

_POLL_S = 0.5
# What a server logs when a port it binds is taken: Python's EADDRINUSE (uvicorn's included),
# and ZMQ's (vLLM's NIXL side channel). Not vLLM's "Address already in use. Retrying": that
# one it handles itself.
PORT_CLASH_MARKERS = ("[Errno 98]", "ZMQError: Address already in use")
# Where a ``dies_with_launcher`` process runs its command. Named, not imported: ``python -m``
# would warn about (and run a second copy of) a module its package had already imported.
_TETHER_MODULE = "agentkv_server.bundle.tether"


class ManagedProcess:
    """One server process. ``start`` returns at once; ``wait_healthy`` blocks until it serves."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        *,
        health_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        fatal_markers: Sequence[str] = (),
        dies_with_launcher: bool = False,
    ) -> None:
        """``dies_with_launcher``: the process stops its group when this (launcher) process
        dies, SIGKILL included; ``command`` must then be ``PYTHON -m MODULE ARGS...``."""
        self.name = name
        self.command = list(command)
        self.dies_with_launcher = dies_with_launcher
        self.health_url = health_url
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        # Log lines that mean the start failed, even while the process lives on.
        self.fatal_markers = (*PORT_CLASH_MARKERS, *fatal_markers)
        self._process: subprocess.Popen[bytes] | None = None
        self._stopped = False  # once stopped, never signal the group id again: it may be reused

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        if self._process is not None:
            raise EngineError(f"{self.name} was already started")
        # Built now: the launcher is the process that starts it.
        command = _tethered(self.command) if self.dies_with_launcher else self.command
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches every child
            )

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Block until the health URL answers 200; raise EngineError (with the log's tail) if
        the process exits, logs a fatal marker, or ``timeout`` seconds pass first.

        A port clash raises PortInUseError, which a caller may answer with other ports.
        """
        deadline = time.monotonic() + timeout
        log = _LogWatch(self.log_path)
        while time.monotonic() < deadline:
            marker = log.first_new(self.fatal_markers)
            if not self.is_running():
                raise self.failure("exited during start-up", port_clash=log.saw_port_clash)
            if marker is not None:
                raise self.failure(f"logged {marker!r} during start-up", log.saw_port_clash)
            if _answers(self.health_url):
                return
            time.sleep(_POLL_S)
        raise self.failure(f"was not healthy after {timeout:.0f} s")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole process group; SIGKILL whatever is left after ``timeout``."""
        if self._process is None or self._stopped:
            return
        self._stopped = True
        _signal_group(self._process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout)
        _signal_group(self._process.pid, signal.SIGKILL)  # children that outlived the leader
        self._process.wait()

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash would."""
        if self._process is None or self._stopped:
            return
        self._stopped = True
        _signal_group(self._process.pid, signal.SIGKILL)
        self._process.wait()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def failure(self, what: str, port_clash: bool = False) -> EngineError:
        """An EngineError (PortInUseError for a port clash) that says what happened and ends
        with the tail of the log."""
        error = PortInUseError if port_clash else EngineError
        return error(f"{self.name} {what}; log {self.log_path}, last lines:\n{self.log_tail()}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' while it does not exist)."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class _LogWatch:
    """Reads what a log file gained since the last look, for markers of a failed start."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._carry = ""  # a line's start, held back until the line is complete
        self.saw_port_clash = False

    def first_new(self, markers: Sequence[str]) -> str | None:
        """The first of ``markers`` found in lines written since the last call, if any."""
        try:
            with open(self._path, "rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except FileNotFoundError:
            return None
        self._offset += len(chunk)
        text = self._carry + chunk.decode(errors="replace")
        complete, _, self._carry = text.rpartition("\n")
        found = next((marker for marker in markers if marker in complete), None)
        self.saw_port_clash |= any(marker in complete for marker in PORT_CLASH_MARKERS)
        return found


def _tethered(command: Sequence[str]) -> list[str]:
    """``command`` run under ``_TETHER_MODULE``, watching this process (its launcher)."""
    python, flag, *module_and_args = command
    if flag != "-m" or not module_and_args:
        raise ValueError(f"only `python -m MODULE ...` can die with its launcher, not {command!r}")
    return [python, "-m", _TETHER_MODULE, str(os.getpid()), "-m", *module_and_args]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
