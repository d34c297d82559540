"""Ports for a stack: outside the kernel's ephemeral range, free, and free again after a stop."""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

import pytest

from agentkv_server.bundle.ports import (
    ensure_ports_free,
    ephemeral_port_range,
    free_ports,
    port_pool,
)
from agentkv_server.errors import ConfigError, PortInUseError
from agentkv_server.wire import PORT_BASE_ENV


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert ephemeral_port_range(setting) == (40000, 50000)
    assert ephemeral_port_range(tmp_path / "missing") == (32768, 60999)


def test_the_pool_never_reaches_into_the_ephemeral_range() -> None:
    low, high = ephemeral_port_range()
    pool = port_pool()
    assert pool and (pool.stop <= low or pool.start > high)
    assert port_pool(25000, ephemeral=(28000, 60999)) == range(25000, 28000)
    assert port_pool(61000, ephemeral=(32768, 60999)).start == 61000


def test_the_base_comes_from_the_environment_and_is_checked() -> None:
    assert port_pool(environ={PORT_BASE_ENV: "12000"}, ephemeral=(32768, 60999)).start == 12000
    with pytest.raises(ConfigError, match="ephemeral range 32768-60999"):
        port_pool(40000, ephemeral=(32768, 60999))
    with pytest.raises(ConfigError, match="must be a port number"):
        port_pool(environ={PORT_BASE_ENV: "lots"})
    with pytest.raises(ConfigError, match="outside"):
        port_pool(80)


def test_free_ports_are_distinct_free_and_from_the_pool() -> None:
    pool = port_pool()
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(port in pool for port in ports)
    ensure_ports_free("127.0.0.1", ports)


def test_free_ports_skip_a_taken_port() -> None:
    """Two neighbouring ports of agentkv's own pool, the first taken by a listener. Not the
    kernel's port 0: that is in the ephemeral range, where a busy machine's connections took
    its neighbour once."""
    with socket.socket() as taken:
        for port in random.Random().sample(port_pool()[:-1], 100):
            try:
                taken.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        taken.listen()
        assert free_ports(1, pool=range(port, port + 2)) == [port + 1]


def test_a_listening_port_is_reported_up_front() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            ensure_ports_free("127.0.0.1", [port])


def test_a_taken_port_names_the_process_that_holds_it() -> None:
    """`agentkv serve` and the soak's restarts say who holds the port, not just that it is held."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError) as raised:
            ensure_ports_free("127.0.0.1", [port])
    assert f"held by pid {os.getpid()} (" in str(raised.value)
    assert Path(sys.executable).name in str(raised.value)


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free() -> None:
    """A stack restarted right after a stop must not be refused: its old connections linger
    in TIME-WAIT on the port, which servers (SO_REUSEADDR) may bind."""
    port = free_ports(1)[0]
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server's side closes first: TIME-WAIT stays on its port
    client.close()
    server.close()
    ensure_ports_free("127.0.0.1", [port])
