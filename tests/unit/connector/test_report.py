"""Holding reports leave from a background thread and never block or raise."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from agentkv_server.connector.report import ATTEMPTS, HoldingReporter, KeepAlivePost
from agentkv_server.testing.conditions import wait_until


class Recorder:
    """A fake POST that records calls; ``gate`` lets a test hold the reporter's thread."""

    def __init__(self, status: int = 204) -> None:
        self.status = status
        self.calls: list[tuple[str, dict, dict]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
        self.gate.wait(5)
        self.calls.append((url, json.loads(body), dict(headers)))
        return self.status


def test_report_is_posted_with_ticket_params_and_secret() -> None:
    post = Recorder()
    reporter = HoldingReporter("http://router/internal/v1/kv-holdings", secret="s", post=post)
    assert reporter.submit("t1", {"remote_num_tokens": 70, "remote_block_ids": [[1, 2]]})
    reporter.close(timeout=5)
    [(url, body, headers)] = post.calls
    assert url == "http://router/internal/v1/kv-holdings"
    assert body == {
        "ticket": "t1",
        "kv_transfer_params": {"remote_num_tokens": 70, "remote_block_ids": [[1, 2]]},
    }
    assert headers["x-agentkv-secret"] == "s"
    assert headers["content-type"] == "application/json"


def test_no_secret_header_without_a_secret() -> None:
    post = Recorder()
    reporter = HoldingReporter("http://r", post=post)
    reporter.submit("t", {})
    reporter.close(timeout=5)
    assert "x-agentkv-secret" not in post.calls[0][2]


def test_full_queue_drops_instead_of_blocking() -> None:
    post = Recorder()
    post.gate.clear()  # the thread takes the first report and waits inside post
    reporter = HoldingReporter("http://r", queue_size=1, post=post)
    results = [reporter.submit(f"t{i}", {}) for i in range(4)]
    assert results[:1] == [True]
    assert not all(results)
    post.gate.set()
    reporter.close(timeout=5)
    assert [body["ticket"] for _, body, _ in post.calls] == [
        f"t{i}" for i, accepted in enumerate(results) if accepted
    ]


def test_delivery_failures_are_retried_a_bounded_number_of_times() -> None:
    """Connection errors and 5xx are retried (ATTEMPTS in all), a 4xx is not; later reports
    still go out."""
    calls: list[str] = []

    def flaky(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
        ticket = json.loads(body)["ticket"]
        calls.append(ticket)
        if ticket == "t1":
            raise ConnectionRefusedError("router down")
        return {"t2": 401, "t3": 503}.get(ticket, 204)

    reporter = HoldingReporter("http://r", post=flaky)
    for ticket in ("t1", "t2", "t3", "t4"):
        reporter.submit(ticket, {})
    reporter.close(timeout=5)
    assert calls == ["t1"] * ATTEMPTS + ["t2"] + ["t3"] * ATTEMPTS + ["t4"]


def test_a_transient_failure_is_retried_until_delivered() -> None:
    attempts: list[int] = []

    def once_down(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionResetError("stale kept-alive connection")
        return 204

    reporter = HoldingReporter("http://r", post=once_down)
    reporter.submit("t", {})
    reporter.close(timeout=5)
    assert len(attempts) == 2


def test_submit_after_close_is_dropped() -> None:
    post = Recorder()
    reporter = HoldingReporter("http://r", post=post)
    reporter.close(timeout=5)
    assert not reporter.submit("late", {})
    assert post.calls == []


class _Router:
    """A real HTTP/1.1 server that answers 204 to the right secret and counts connections."""

    def __init__(self) -> None:
        seen = self.seen = []
        connections = self.connections = []
        closed = self.closed = []  # connections this server has closed
        drops = self.drops = []  # answer, then close the connection without saying so

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def setup(self) -> None:
                super().setup()
                connections.append(self.client_address)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                seen.append((self.path, body, self.headers.get("x-agentkv-secret")))
                self.send_response(204 if self.headers.get("x-agentkv-secret") == "s" else 401)
                self.send_header("content-length", "0")
                self.end_headers()
                if drops:
                    drops.pop()
                    self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def shutdown_request(self, request: socket.socket) -> None:
                super().shutdown_request(request)
                closed.append(request)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/internal/v1/kv-holdings"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_keep_alive_post_speaks_http_over_one_connection() -> None:
    router = _Router()
    post = KeepAlivePost()
    try:
        assert post(router.url, b"{}", {"x-agentkv-secret": "s"}, 5.0) == 204
        assert post(router.url, b"{}", {}, 5.0) == 401
        assert post(router.url, b"{}", {"x-agentkv-secret": "s"}, 5.0) == 204
    finally:
        post.close()
        router.stop()
    assert router.seen[0] == ("/internal/v1/kv-holdings", b"{}", "s")
    assert len(router.seen) == 3
    assert len(router.connections) == 1


def test_reporter_reconnects_after_the_router_dropped_its_connection() -> None:
    """The router closing an idle kept-alive connection costs a retry, not the report."""
    router = _Router()
    reporter = HoldingReporter(router.url, secret="s")
    try:
        router.drops.append(True)
        reporter.submit("t1", {})
        wait_until(lambda: router.closed, "closed by the router")
        reporter.submit("t2", {})
        reporter.close(timeout=5)
    finally:
        router.stop()
    assert [json.loads(body)["ticket"] for _, body, _ in router.seen] == ["t1", "t2"]
    assert len(router.connections) == 2
