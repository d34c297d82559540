"""Holding reports, decode engine -> router (docs/protocol.md section 5).

vLLM returns a finished request's ``kv_transfer_params`` only in non-streaming responses, so
the router would never learn what a streamed turn left on the decode engine. The connector
sees every finish, so it reports the params itself: ``POST {"ticket", "kv_transfer_params"}``
to the router. Reports leave from one background thread through a bounded queue; the engine's
scheduler never waits on the network. The thread keeps one connection to the router alive and
retries a failed delivery a bounded number of times (a stale kept-alive connection, a router
restarting, a 5xx); a report that cannot be queued or delivered is dropped and logged (the router
then treats the session's next turn as a recompute).
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Final

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    wait_exponential,
)

from agentkv_server import wire
from agentkv_server.connector.log import get_logger

__all__ = ["HoldingReporter", "KeepAlivePost", "Post"]

logger = get_logger(__name__)

# (url, body, headers, timeout) -> HTTP status. Injected in tests.
Post = Callable[[str, bytes, Mapping[str, str], float], int]

_STOP: Final = object()


# Deliveries tried per report, and the pause before a retry: a retry holds up the reports queued
# behind it, and the router waits only ``timeouts.report_s`` (0.5 s) for a streamed turn's report.
ATTEMPTS: Final = 3
_RETRY_WAIT = wait_exponential(multiplier=0.05, max=0.2)


class KeepAlivePost:
    """POST with the standard library over one kept-alive connection (engines carry no HTTP
    client of ours); a connection that failed is dropped and the next call opens a new one.
    Not thread-safe: the reporter's thread is its only user."""

    def __init__(self) -> None:
        self._connection: http.client.HTTPConnection | None = None
        self._origin: tuple[str, str, int | None] | None = None

    def __call__(self, url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
        parts = urllib.parse.urlsplit(url)
        connection = self._connect(parts, timeout)
        try:
            connection.request("POST", parts.path or "/", body=body, headers=dict(headers))
            with connection.getresponse() as response:
                response.read()
                return int(response.status)
        except (OSError, http.client.HTTPException):
            self.close()
            raise

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self._connection = None

    def _connect(
        self, parts: urllib.parse.SplitResult, timeout: float
    ) -> http.client.HTTPConnection:
        origin = (parts.scheme, parts.hostname or "", parts.port)
        if self._connection is None or origin != self._origin:
            self.close()
            kind = (
                http.client.HTTPSConnection
                if parts.scheme == "https"
                else http.client.HTTPConnection
            )
            self._connection = kind(origin[1], origin[2], timeout=timeout)
            self._origin = origin
        self._connection.timeout = timeout
        return self._connection


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
        post: Post | None = None,
    ) -> None:
        self._url = url
        self._headers = {"content-type": "application/json"}
        if secret:
            self._headers[wire.SECRET_HEADER] = secret
        self._timeout = timeout
        self._own_post = KeepAlivePost() if post is None else None
        self._post = post or self._own_post
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(
            target=self._run, name="agentkv-holding-reporter", daemon=True
        )
        self._thread.start()

    def submit(self, ticket: str, kv_transfer_params: Mapping[str, Any]) -> bool:
        """Queue one report; False (and a warning) when the queue is full or closed."""
        report = wire.holding_report(ticket, kv_transfer_params)
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
        if self._own_post is not None:
            self._own_post.close()

    def _deliver(self, report: dict[str, Any]) -> None:
        body = json.dumps(report, separators=(",", ":")).encode()
        retrying = Retrying(
            stop=stop_after_attempt(ATTEMPTS),
            wait=_RETRY_WAIT,
            retry=retry_if_exception_type((OSError, http.client.HTTPException))
            | retry_if_result(lambda status: status >= 500),
        )
        try:
            status = retrying(self._post, self._url, body, self._headers, self._timeout)
        except RetryError as error:
            logger.warning(
                "Holding report for ticket %s not delivered after %d attempts: %s",
                report[wire.REPORT_TICKET],
                ATTEMPTS,
                _outcome(error),
            )
            return
        except ValueError as error:  # a URL http.client cannot use: retrying will not help
            logger.warning(
                "Holding report for ticket %s not delivered: %s", report[wire.REPORT_TICKET], error
            )
            return
        if not 200 <= status < 300:
            logger.warning(
                "Holding report for ticket %s refused by the router: HTTP %d",
                report[wire.REPORT_TICKET],
                status,
            )


def _outcome(error: RetryError) -> str:
    last = error.last_attempt
    return repr(last.exception()) if last.failed else f"HTTP {last.result()}"
