"""Holding reports, decode engine -> router (docs/protocol.md section 5).

vLLM returns a finished request's ``kv_transfer_params`` only in non-streaming responses, so
the router would never learn what a streamed turn left on the decode engine. The connector
sees every finish, so it reports the params itself: ``POST {"ticket", "kv_transfer_params"}``
to the router. Reports leave from one background thread through a bounded queue; the engine's
scheduler never waits on the network, and a report that cannot be queued or delivered is
dropped and logged (the router then treats the session's next turn as a recompute).
"""

from __future__ import annotations

import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Final

from agentkv_server.connector.log import get_logger

__all__ = ["SECRET_HEADER", "HoldingReporter", "Post", "post_json"]

logger = get_logger(__name__)

SECRET_HEADER: Final = "x-agentkv-secret"

# (url, body, headers, timeout) -> HTTP status. Injected in tests.
Post = Callable[[str, bytes, Mapping[str, str], float], int]

_STOP: Final = object()


def post_json(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
    """POST ``body`` with the standard library (engines carry no HTTP client of ours)."""
    request = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


class HoldingReporter:
    """Delivers holding reports to one router URL from a daemon thread.

    ``submit`` never blocks; ``close`` stops the thread after the reports already queued.
    """

    def __init__(
        self,
        url: str,
        *,
        secret: str | None = None,
        queue_size: int = 1024,
        timeout: float = 2.0,
        post: Post = post_json,
    ) -> None:
        self._url = url
        self._headers = {"content-type": "application/json"}
        if secret:
            self._headers[SECRET_HEADER] = secret
        self._timeout = timeout
        self._post = post
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(
            target=self._run, name="agentkv-holding-reporter", daemon=True
        )
        self._thread.start()

    def submit(self, ticket: str, kv_transfer_params: Mapping[str, Any]) -> bool:
        """Queue one report; False (and a warning) when the queue is full or closed."""
        report = {"ticket": ticket, "kv_transfer_params": dict(kv_transfer_params)}
        if not self._thread.is_alive():
            logger.warning("Holding report for ticket %s dropped: reporter closed", ticket)
            return False
        try:
            self._queue.put_nowait(report)
        except queue.Full:
            logger.warning("Holding report for ticket %s dropped: queue full", ticket)
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued, then stop the thread (waiting at most ``timeout``)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            logger.warning(
                "Holding reporter closed with %d reports undelivered", self._queue.qsize()
            )
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while (report := self._queue.get()) is not _STOP:
            assert isinstance(report, dict)
            self._deliver(report)

    def _deliver(self, report: dict[str, Any]) -> None:
        body = json.dumps(report, separators=(",", ":")).encode()
        try:
            status = self._post(self._url, body, self._headers, self._timeout)
        except (OSError, ValueError) as error:
            logger.warning(
                "Holding report for ticket %s not delivered: %s", report["ticket"], error
            )
            return
        if not 200 <= status < 300:
            logger.warning(
                "Holding report for ticket %s refused by the router: HTTP %d",
                report["ticket"],
                status,
            )
