"""PeerProbe: a refused or silent handshake listener marks its peer dead, off the caller's thread."""

from __future__ import annotations

import socket
import threading
import time

from agentkv_server.connector.peers import PeerProbe


def settled(probe: PeerProbe, seconds: float = 5.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not probe._running or all(check.done() for check in probe._running.values()):
            return probe.dead()
        time.sleep(0.01)
    raise AssertionError("probe did not finish")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_listening_peer_is_alive_and_a_closed_port_is_dead() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        probe = PeerProbe(timeout=0.5, interval=1.0)
        probe.probe("live", "127.0.0.1", listener.getsockname()[1], now=0.0)
        probe.probe("gone", "127.0.0.1", closed_port(), now=0.0)
        assert settled(probe) == ["gone"]
        assert probe.dead() == []  # each death is handed back once
        probe.shutdown()


def test_a_peer_is_probed_at_most_once_per_interval() -> None:
    calls: list[tuple[str, int]] = []
    release = threading.Event()

    def connect(address: tuple[str, int], timeout: float) -> None:
        calls.append(address)
        release.wait(5)
        raise ConnectionRefusedError

    probe = PeerProbe(timeout=0.5, interval=1.0, connect=connect)
    probe.probe("d", "h", 1, now=0.0)
    probe.probe("d", "h", 1, now=5.0)  # still running: not started twice
    release.set()
    assert settled(probe) == ["d"]
    probe.probe("d", "h", 1, now=0.5)  # within the interval of the last start
    probe.probe("d", "h", 1, now=1.0)
    assert settled(probe) == ["d"]
    assert calls == [("h", 1), ("h", 1)]
    probe.shutdown()
