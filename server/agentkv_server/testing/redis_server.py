"""A throwaway redis-server on a free loopback port, for tests of the shared session store
(or on a given address and port, started through ``wrapper``: inside a test host's namespace).

No persistence: stopping it loses every key, as a Redis that crashed and came back empty.
It can be stopped and started again on the same port, which is how tests make Redis go away.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence

from typing_extensions import Self

__all__ = ["RedisServer"]


class RedisServer:
    """``with RedisServer() as redis: ... redis.url``; ``stop()`` and ``start()`` in between."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("redis-server not found (scripts/install installs it)")
        self._binary = found
        self._wrapper = list(wrapper)  # e.g. ip netns exec NS: serve inside another namespace
        self.host = host
        self.port = port or _free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start serving and return once it answers PING."""
        self._process = subprocess.Popen(
            [*self._wrapper, self._binary, "--port", str(self.port), "--bind", self.host]
            + ["--save", "", "--appendonly", "no"]
            # Without a password Redis answers only loopback clients unless told otherwise: a
            # server on a test host's address serves the other test hosts.
            + ["--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._process.returncode}")
            if self._answers_ping():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING in time")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
