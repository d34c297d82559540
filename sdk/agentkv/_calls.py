"""The choke point: a model request on its way to the server, tagged inside a session.

agentkv works on the HTTP request that openai (or a framework's openai client) is about to send:
whatever call path built it (``create``, ``parse``, the ``stream()`` helpers, ``with_raw_response``,
``with_streaming_response``, paths openai adds later), a ``POST`` to ``/chat/completions``,
``/completions`` or ``/responses`` made inside a session is tagged, and its response is read as it
goes by to record the turn. Any failure of agentkv's own bookkeeping is logged and the request goes
on as it was.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final, ParamSpec

from agentkv._results import finish_reason, kv_path, kv_reason, reused_tokens, server_timing
from agentkv._session import Session, TurnInfo, current_session
from agentkv._tagging import TurnTags, headers_to_add, is_tool_continuation, tag_body

__all__ = ["MODEL_CALL_PATHS", "ModelCall"]

logger = logging.getLogger("agentkv")

_P = ParamSpec("_P")

MODEL_CALL_PATHS: Final = ("/chat/completions", "/completions", "/responses")
"""Endpoints whose POST is a model call (``/responses/compact``, ``/responses/input_tokens``... are
not: they end differently)."""

# openai numbers the attempts of one call; a retry repeats the attempt's turn instead of taking
# a new one. Only the latest unanswered call of each session can be retried.
_RETRY_COUNT_HEADER: Final = "x-stainless-retry-count"
_unanswered_lock = threading.Lock()
_unanswered: weakref.WeakKeyDictionary[Session, tuple[bytes, TurnTags]] = (
    weakref.WeakKeyDictionary()
)


def _shielded(method: Callable[_P, None]) -> Callable[_P, None]:
    """Bookkeeping that must never raise into the user's call: failures are logged instead."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            logger.exception("agentkv: %s failed; the call goes on untracked", method.__qualname__)

    return run


class ModelCall:
    """One model call inside a session, from its tags to the :class:`TurnInfo` it leaves.

    The response body is fed to it as it arrives (JSON, or server-sent events for a streamed
    call); the turn is recorded once, when the body ends or is closed.
    """

    def __init__(self, session: Session, tags: TurnTags, *, streamed: bool) -> None:
        self._session = session
        self._tags = tags
        self._streamed = streamed
        self._started_at = time.monotonic()
        self._first_chunk_at: float | None = None
        self._finish_reason: str | None = None
        self._headers: Mapping[str, str] = {}
        self._pending = b""
        self._finished = False

    @classmethod
    def start(cls, request: Any, *, send_body: bool) -> tuple[ModelCall, Any] | None:
        """Tags ``request`` (an httpx request) in the current session.

        Returns the call and the request to send, or None (send ``request`` as is) outside a
        session, for requests that are no model call, or when tagging fails.
        """
        session = current_session()
        if session is None:
            return None
        try:
            body = _model_call_body(request)
            if body is None:
                return None
            tags = _turn_tags(session, request, body)
            call = cls(session, tags, streamed=bool(body.get("stream")))
            return call, _tagged_request(request, body, tags, send_body=send_body)
        except Exception:
            logger.exception("agentkv: could not tag a model call; sending it untagged")
            return None

    def responded(self, response: Any, *, body_read: bool) -> None:
        """``response`` arrived; with ``body_read`` its whole body is in ``response.content``."""
        if response.status_code >= 400:
            return  # the call fails (or openai retries it): no turn to record
        with _unanswered_lock:
            _unanswered.pop(self._session, None)
        self._headers = response.headers
        if body_read:
            self.chunk(response.content)
            self.finish()

    @_shielded
    def chunk(self, data: bytes) -> None:
        """A piece of the response body arrived."""
        if not self._streamed:
            self._pending += data
            return
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._event(line)

    def _event(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]" or not payload:
            return
        if self._first_chunk_at is None:
            self._first_chunk_at = time.monotonic()
        self._note_finish_reason(json.loads(payload))

    def _note_finish_reason(self, result: object) -> None:
        if isinstance(result, Mapping) and (reason := finish_reason(result)):
            self._finish_reason = reason

    @_shielded
    def finish(self) -> None:
        """Records the turn once: on the body's end, an error or a close."""
        if self._finished:
            return
        self._finished = True
        ended_at = time.monotonic()
        if self._streamed:
            self._event(self._pending.strip())
        elif self._pending:
            self._first_chunk_at = ended_at
            self._note_finish_reason(json.loads(self._pending))
        ttft = None if self._first_chunk_at is None else self._first_chunk_at - self._started_at
        info = TurnInfo(
            turn=self._tags.turn,
            tool_continuation=self._tags.tool_continuation,
            session_end=self._tags.session_end,
            kv_path=kv_path(self._headers),
            reused_tokens=reused_tokens(self._headers),
            ttft_seconds=ttft,
            finish_reason=self._finish_reason,
            server_timing=server_timing(self._headers),
            kv_reason=kv_reason(self._headers),
        )
        self._session._complete_turn(info, ended_at=ended_at)


def _model_call_body(request: Any) -> dict[str, Any] | None:
    if request.method != "POST" or not request.url.path.endswith(MODEL_CALL_PATHS):
        return None
    body = json.loads(request.content)
    return body if isinstance(body, dict) else None


def _turn_tags(session: Session, request: Any, body: dict[str, Any]) -> TurnTags:
    digest = hashlib.blake2b(request.content, digest_size=16).digest()
    with _unanswered_lock:
        if request.headers.get(_RETRY_COUNT_HEADER, "0") != "0":
            earlier = _unanswered.get(session)
            if earlier is not None and earlier[0] == digest:
                return earlier[1]
        tags = session._start_turn(tool_continuation=is_tool_continuation(body))
        _unanswered[session] = (digest, tags)
        return tags


def _tagged_content(content: bytes, body: dict[str, Any], tags: TurnTags) -> bytes:
    """The JSON body with the turn's fields; new top-level fields are spliced in before the
    closing brace, so a long conversation is not serialized a second time."""
    tagged = tag_body(body, tags)
    if any(tagged[key] is not body[key] for key in body):  # a null field was filled in
        return json.dumps(tagged).encode()
    added = json.dumps({key: value for key, value in tagged.items() if key not in body})
    end = content.rindex(b"}")
    separator = b"," if body else b""
    return content[:end] + separator + added[1:-1].encode() + content[end:]


def _tagged_request(request: Any, body: dict[str, Any], tags: TurnTags, *, send_body: bool) -> Any:
    """A copy of ``request`` (httpx or httpx2) with the turn's headers and body fields added."""
    headers = [
        (name, value) for name, value in request.headers.multi_items() if name != "content-length"
    ]
    headers += list(headers_to_add(tags, request.headers.keys()).items())
    content = _tagged_content(request.content, body, tags) if send_body else request.content
    return type(request)(
        request.method,
        request.url,
        headers=headers,
        content=content,
        extensions=request.extensions,
    )
