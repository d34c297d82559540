"""The processes ``agentkv bench router`` starts on loopback: stub engines (``python -m
agentkv_server.testing``), agentkv routers (``agentkv router``) and vllm-router, each logging
to a file of its own, and what it reads of them (health, CPU time, resident memory).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

from agentkv_server.errors import EngineError

__all__ = [
    "Stubs",
    "cpu_seconds",
    "free_port",
    "new_secret",
    "process",
    "router_argv",
    "rss_mib",
    "start_stubs",
    "stub_argv",
    "vllm_router_argv",
    "wait_healthy",
]


@dataclass(frozen=True)
class Stubs:
    """A stub prefill and a stub decode engine, served by one process."""

    prefill: str
    decode: str
    pid: int


def new_secret() -> str:
    # Hex, not token_urlsafe: a secret starting with "-" would read as an option.
    return secrets.token_hex(16)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def process(argv: Sequence[str], log: Path, **kwargs: object) -> Iterator[subprocess.Popen[str]]:
    """``argv`` running, its output in ``log`` (stdout too unless given); ended on exit."""
    with open(log, "w") as out:
        kwargs.setdefault("stdout", out)
        proc = subprocess.Popen(list(argv), text=True, stderr=out, **kwargs)  # type: ignore[call-overload]
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[str], deadline_s: float = 60.0) -> None:
    """Poll ``GET {url}/health`` every 0.1 s until it answers 200; fail at once if ``proc``
    exits."""

    def status() -> int:
        if proc.poll() is not None:
            raise EngineError(f"{Path(proc.args[0]).name} exited with {proc.returncode} ({url})")
        with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
            return int(answer.status)

    polls = Retrying(
        stop=stop_after_delay(deadline_s),
        wait=wait_fixed(0.1),
        retry=retry_if_exception_type(OSError) | retry_if_result(lambda code: code != 200),
    )
    try:
        polls(status)
    except RetryError:
        raise EngineError(f"{url} did not become healthy in {deadline_s:g} s") from None


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def stub_argv(
    router_url: str, secret: str, *, prefill_us_per_token: float = 0.0, record: bool = True
) -> list[str]:
    """One process serving a stub prefill and a stub decode engine (the prefill stub pulls what
    the decode stub holds, in memory), reporting holdings to ``router_url``."""
    argv = [sys.executable, "-m", "agentkv_server.testing", "--engines", "2"]
    argv += ["--router-url", router_url, "--secret", secret]
    if prefill_us_per_token:
        argv += ["--prefill-us-per-token", str(prefill_us_per_token)]
    return argv + ([] if record else ["--no-record"])


def router_argv(
    port: int,
    secret: str,
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    redis_url: str | None = None,
    max_sessions: int | None = None,
) -> list[str]:
    """``agentkv router`` (this interpreter's) in front of the given engines."""
    argv = [sys.executable, "-m", "agentkv_server.cli", "router", "--port", str(port)]
    argv += ["--secret", secret, "--decode-url", *decode, "--log-level", "warning"]
    if prefill:
        argv += ["--prefill-url", *prefill]
    if redis_url:
        argv += ["--redis-url", redis_url]
    if max_sessions is not None:
        argv += ["--max-sessions", str(max_sessions)]
    return argv


def vllm_router_argv(binary: str, port: int, stubs: Stubs) -> list[str]:
    """vllm-router (Rust) in P/D mode in front of the stubs."""
    argv = [binary, "--vllm-pd-disaggregation", "--prefill", stubs.prefill]
    argv += ["--decode", stubs.decode]
    return argv + ["--port", str(port), "--policy", "round_robin", "--log-level", "warning"]


@contextlib.contextmanager
def start_stubs(
    router_url: str, secret: str, log: Path, *, prefill_us_per_token: float = 0.0, record: bool
) -> Iterator[Stubs]:
    """The stub pair, up and listening (the process prints their URLs once they are)."""
    argv = stub_argv(router_url, secret, prefill_us_per_token=prefill_us_per_token, record=record)
    with process(argv, log, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise EngineError(f"the stub engines exited with {proc.wait()} (log: {log})")
        prefill, decode = json.loads(line)
        yield Stubs(prefill, decode, proc.pid)
