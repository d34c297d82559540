"""A server process the bundle owns: started in its own process group, logged to a file, polled
until its health URL answers, and stopped with everything it forked.

vLLM forks an EngineCore and a worker process per engine; signalling only the process we
started would orphan them. Each managed process therefore leads a new session (its own
process group), and stopping it signals the whole group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from typing_extensions import Self

from agentkv_server.errors import EngineError

__all__ = ["ManagedProcess", "ensure_ports_free", "free_ports", "log_tail"]

_POLL_S = 0.5


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
    ) -> None:
        self.name = name
        self.command = list(command)
        self.health_url = health_url
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches every child
            )

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Block until the health URL answers 200; raise EngineError (with the log's tail) if
        the process exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise self.failure("exited during start-up")
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

    def failure(self, what: str) -> EngineError:
        """An EngineError that says what happened and ends with the tail of the log."""
        return EngineError(
            f"{self.name} {what}; log {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def ensure_ports_free(host: str, ports: Sequence[int]) -> None:
    """Raise EngineError naming the first port on ``host`` that is already taken, before a
    server spends half a minute starting only to fail to bind."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise EngineError(
                    f"port {port} on {host} is already in use ({exc.strerror})"
                ) from None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that nothing listens on now (all held open while choosing)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


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


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
