"""Ports for the servers a stack starts, chosen where nothing else will take them.

Asking the kernel for port 0 hands out a port from the *ephemeral* range, the same range the
kernel draws from for every outgoing connection and for listeners that bind port 0, such as
the TCP listeners UCX opens inside each engine. A port chosen that way and bound a few seconds
later by an engine's NIXL side channel can meanwhile have been taken by that very engine's UCX
worker: the side channel then fails with "Address already in use" (docs/faults.md). Ports are
therefore drawn at random from a pool *outside* the ephemeral range, each checked free.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from agentkv_server.errors import ConfigError, EngineError, PortInUseError
from agentkv_server.wire import PORT_BASE_ENV

__all__ = [
    "ensure_ports_free",
    "ephemeral_port_range",
    "free_ports",
    "port_pool",
]

_EPHEMERAL_RANGE_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_DEFAULT_EPHEMERAL: Final = (32768, 60999)
_DEFAULT_BASE: Final = 20000
_POOL_SIZE: Final = 8000
_FIRST_UNPRIVILEGED: Final = 1024
_COMMAND_LINE_CHARS: Final = 160


def ephemeral_port_range(path: Path = _EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive); Linux's default where it cannot be read."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return _LINUX_DEFAULT_EPHEMERAL
    return low, high


def port_pool(
    base: int | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    ephemeral: tuple[int, int] | None = None,
) -> range:
    """The ports a stack may use: ``_POOL_SIZE`` ports from ``base`` (default: ``$AGENTKV_PORT_BASE``
    or 20000), clipped to end where the ephemeral range begins.

    A base inside the ephemeral range is a ConfigError: it would bring the start race back.
    """
    if base is None:
        raw = environ.get(PORT_BASE_ENV, "")
        try:
            base = int(raw) if raw else _DEFAULT_BASE
        except ValueError:
            raise ConfigError(f"{PORT_BASE_ENV} must be a port number, got {raw!r}") from None
    low, high = ephemeral or ephemeral_port_range()
    if not _FIRST_UNPRIVILEGED <= base <= 65535 - 16:
        raise ConfigError(f"port base {base} is outside {_FIRST_UNPRIVILEGED}-{65535 - 16}")
    if low <= base <= high:
        raise ConfigError(
            f"port base {base} lies in the kernel's ephemeral range {low}-{high} "
            f"(net.ipv4.ip_local_port_range), which outgoing connections and UCX listeners use; "
            f"choose a base below {low} or above {high} ({PORT_BASE_ENV} or --port-base)"
        )
    end = min(base + _POOL_SIZE, 65536)
    if base < low:
        end = min(end, low)
    return range(base, end)


def free_ports(count: int, host: str = "127.0.0.1", *, pool: range | None = None) -> list[int]:
    """``count`` distinct ports from ``pool`` (default ``port_pool()``) that are free now.

    Candidates are tried in random order, so that stacks started side by side rarely pick the
    same ports; all chosen ports are held open until the choice is complete.
    """
    pool = port_pool() if pool is None else pool
    if count > len(pool):
        raise ConfigError(
            f"{count} ports asked for, the pool {pool.start}-{pool.stop - 1} is smaller"
        )
    with contextlib.ExitStack() as held:
        chosen: list[int] = []
        for port in random.sample(pool, len(pool)):
            sock = _listener_socket(host)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            held.enter_context(sock)
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise EngineError(f"fewer than {count} free ports on {host} in {pool.start}-{pool.stop - 1}")


def ensure_ports_free(host: str, ports: Sequence[int]) -> None:
    """Raise PortInUseError naming the first port on ``host`` that a server could not bind now,
    and the processes holding it where psutil can see them.

    The probe binds the way servers do (``SO_REUSEADDR``), so connections of a stack that just
    stopped, still in TIME-WAIT, do not block a restart; a listener does.
    """
    for port in ports:
        with _listener_socket(host) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise PortInUseError(
                    f"port {port} on {host} is already in use ({exc.strerror}){_held_by(port)}; "
                    "is another agentkv stack or server running?"
                ) from None


def _port_holders(port: int) -> list[str]:
    """``pid N (command line)`` of each process with a TCP socket bound to local ``port``, as
    far as this user may see them (others' sockets have no pid for an unprivileged user).
    psutil comes with the engine extras; without it no process is named."""
    try:
        import psutil
    except ImportError:
        return []
    holders = []
    try:
        connections = psutil.net_connections(kind="tcp")
        pids = sorted({c.pid for c in connections if c.laddr and c.laddr.port == port and c.pid})
        for pid in pids:
            line = " ".join(psutil.Process(pid).cmdline()) or "?"
            holders.append(f"pid {pid} ({_shortened(line)})")
    except psutil.Error:
        pass  # a holder that exited meanwhile, or sockets this user may not see
    return holders


def _held_by(port: int) -> str:
    holders = _port_holders(port)
    return f", held by {', '.join(holders)}" if holders else ""


def _shortened(line: str) -> str:
    return line if len(line) <= _COMMAND_LINE_CHARS else line[: _COMMAND_LINE_CHARS - 3] + "..."


def _listener_socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock
