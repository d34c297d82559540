"""Is a pull's peer still there? Asked off the engine's worker thread, answered in milliseconds.

A read from a holder that was killed does not always fail: UCX may report it in progress until
its own peer-failure detection (keepalive) fires, tens of seconds later, and the request waits
that long. The holder's NIXL handshake listener lives in the holder's worker process, so a TCP
connect to it is refused the moment that process is gone.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["PeerProbe"]

Connect = Callable[[tuple[str, int], float], object]


def _connect(address: tuple[str, int], timeout: float) -> object:
    with socket.create_connection(address, timeout=timeout):
        return None


class PeerProbe:
    """Background TCP probes of peers' handshake listeners, at most one per peer per interval.

    ``probe`` never blocks: it starts a check unless one is running or the last one is younger
    than ``interval``; ``dead`` hands back (once) the peers whose listener refused or did not
    answer within ``timeout``. Times are from one caller's clock, as in ``Deadlines``.
    """

    def __init__(self, *, timeout: float, interval: float, connect: Connect = _connect) -> None:
        self._timeout = timeout
        self._interval = interval
        self._connect = connect
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentkv-peer-probe")
        self._running: dict[str, Future[bool]] = {}
        self._last: dict[str, float] = {}

    def probe(self, peer: str, host: str, port: int, now: float) -> None:
        """Start checking ``peer`` at ``host:port`` unless checked recently or still checking."""
        if peer in self._running or now - self._last.get(peer, -self._interval) < self._interval:
            return
        self._last[peer] = now
        self._running[peer] = self._executor.submit(self._answers, host, port)

    def dead(self) -> list[str]:
        """Peers whose finished check failed since the last call."""
        finished = [peer for peer, check in self._running.items() if check.done()]
        return [peer for peer in finished if not self._running.pop(peer).result()]

    def _answers(self, host: str, port: int) -> bool:
        try:
            self._connect((host, port), self._timeout)
        except OSError:
            return False
        return True

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
