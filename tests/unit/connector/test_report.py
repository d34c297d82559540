"""Holding reports leave from a background thread and never block or raise."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer

from agentkv_server.connector.report import HoldingReporter, post_json


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


def test_delivery_failures_are_swallowed_and_later_reports_still_go_out() -> None:
    calls: list[str] = []

    def flaky(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
        ticket = json.loads(body)["ticket"]
        calls.append(ticket)
        if ticket == "t1":
            raise ConnectionRefusedError("router down")
        return 401 if ticket == "t2" else 204

    reporter = HoldingReporter("http://r", post=flaky)
    for ticket in ("t1", "t2", "t3"):
        reporter.submit(ticket, {})
    reporter.close(timeout=5)
    assert calls == ["t1", "t2", "t3"]


def test_submit_after_close_is_dropped() -> None:
    post = Recorder()
    reporter = HoldingReporter("http://r", post=post)
    reporter.close(timeout=5)
    assert not reporter.submit("late", {})
    assert post.calls == []


def test_post_json_speaks_http_and_returns_error_statuses() -> None:
    seen: list[tuple[str, bytes, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            seen.append((self.path, body, self.headers.get("x-agentkv-secret")))
            self.send_response(204 if self.headers.get("x-agentkv-secret") == "s" else 401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/internal/v1/kv-holdings"
    try:
        assert post_json(url, b"{}", {"x-agentkv-secret": "s"}, 5.0) == 204
        assert post_json(url, b"{}", {}, 5.0) == 401
    finally:
        server.shutdown()
    assert seen[0] == ("/internal/v1/kv-holdings", b"{}", "s")
