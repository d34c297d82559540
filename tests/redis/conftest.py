"""A real redis-server on a free loopback port, started once per test session."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

REDIS_SERVER = shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_ready(
    port: int, process: subprocess.Popen[bytes], deadline_s: float = 10.0
) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not answer PING in time")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a throwaway redis-server (no persistence), stopped after the session."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found (scripts/install installs it via apt)")
    port = _free_port()
    process = subprocess.Popen(
        [
            REDIS_SERVER,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_ready(port, process)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
async def redis_url(redis_server: str) -> AsyncIterator[str]:
    """The server's URL, with an empty database for each test."""
    client = Redis.from_url(redis_server)
    await client.flushdb()
    await client.aclose()
    yield redis_server
