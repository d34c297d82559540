"""Sessions: which model calls belong to one agent run, and what happened on each of them.

The active session lives in a ``contextvars`` variable, so concurrent asyncio tasks and threads
each see their own. Each context holds a stack, which lets sessions nest (a sub-agent's session
inside its parent's) and lets one session be re-entered, without tokens that would tie an exit to
the context of the matching entry.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, overload

from typing_extensions import Self

from agentkv._exceptions import SessionError
from agentkv._prediction import NextTurnPredictor
from agentkv._tagging import TurnTags
from agentkv.protocol import is_valid_session_id

__all__ = ["Session", "TurnInfo", "current_session", "session"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

_active: ContextVar[tuple[Session, ...]] = ContextVar("agentkv_sessions", default=())


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """One completed model call of a session, as the client saw it and the router reported it."""

    turn: int
    tool_continuation: bool
    session_end: bool
    kv_path: str | None
    """``local``, ``reuse``, ``recompute`` or ``fallback`` (protocol.md section 3); None without
    a router."""
    reused_tokens: int | None
    ttft_seconds: float | None
    """Seconds to the first streamed chunk; for a non-streaming call, to the whole response."""
    finish_reason: str | None
    server_timing: Mapping[str, float] = field(default_factory=dict)
    """The router's steps before the first byte, in seconds (protocol.md section 3)."""
    kv_reason: str | None = None
    """Why the router chose ``kv_path`` (e.g. ``none_held``, ``pull_cheaper``; protocol.md
    section 3); None without a router or a session."""


class Session:
    """An agent run whose model calls share one id, a turn counter and a next-turn prediction.

    Use it as ``with``, ``async with`` or as a decorator; see :func:`session`.
    """

    def __init__(self, session_id: str | None = None, *, next_turn_seconds: float | None = None):
        if session_id is not None and not (
            isinstance(session_id, str) and is_valid_session_id(session_id)
        ):
            raise SessionError(
                f"invalid session id {session_id!r}: use 1-128 characters of [A-Za-z0-9._:@/+=-]"
            )
        if next_turn_seconds is not None and next_turn_seconds < 0:
            raise SessionError(f"next_turn_seconds must be >= 0, got {next_turn_seconds}")
        self._requested_id = session_id
        self._initial_next_turn_seconds = next_turn_seconds
        self._id = session_id if session_id is not None else uuid.uuid4().hex
        self._lock = threading.Lock()
        self._turn = 0
        self._end_next = False
        self._predictor = NextTurnPredictor(initial_seconds=next_turn_seconds)
        self._turns: list[TurnInfo] = []

    def __repr__(self) -> str:
        return f"<agentkv.Session id={self._id!r} turn={self._turn}>"

    @property
    def id(self) -> str:
        return self._id

    @property
    def turn(self) -> int:
        """Model calls made in this session so far (the index of the latest one)."""
        return self._turn

    @property
    def predicted_next_turn_seconds(self) -> float | None:
        """Predicted seconds from a tool-calling response to the next call; None until known."""
        with self._lock:
            return self._predictor.seconds

    @property
    def last_turn(self) -> TurnInfo | None:
        """The most recently completed call, or None before the first one completes."""
        with self._lock:
            return self._turns[-1] if self._turns else None

    @property
    def turns(self) -> list[TurnInfo]:
        """Every completed call, oldest first (a copy)."""
        with self._lock:
            return list(self._turns)

    def end_next_turn(self) -> None:
        """Marks the coming model call as the session's last: the router frees its KV after it."""
        with self._lock:
            self._end_next = True

    def record_tool_time(self, seconds: float) -> None:
        """Feeds a measured tool step (framework adapters know when tools start and end)."""
        if seconds < 0:
            raise SessionError(f"tool time must be >= 0, got {seconds}")
        with self._lock:
            self._predictor.add(seconds)

    def _start_turn(self, *, tool_continuation: bool) -> TurnTags:
        """Allocates the next turn for a model call that is about to be sent."""
        with self._lock:
            self._predictor.call_started(time.monotonic())
            self._turn += 1
            session_end, self._end_next = self._end_next, False
            return TurnTags(
                session_id=self._id,
                turn=self._turn,
                tool_continuation=tool_continuation,
                session_end=session_end,
                next_turn_seconds=None if session_end else self._predictor.seconds,
            )

    def _complete_turn(self, info: TurnInfo, *, ended_at: float) -> None:
        """Records a call whose response ended (its last byte arrived) at ``ended_at``."""
        with self._lock:
            self._turns.append(info)
            self._predictor.response_ended(info.finish_reason, ended_at)

    def __enter__(self) -> Self:
        _active.set((*_active.get(), self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _active.get()
        if self not in stack:
            raise SessionError(f"{self!r} is not active in this context")
        innermost = len(stack) - 1 - stack[::-1].index(self)
        _active.set(stack[:innermost] + stack[innermost + 1 :])

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    @overload
    def __call__(self, func: Callable[_P, Awaitable[_R]]) -> Callable[_P, Awaitable[_R]]: ...

    @overload
    def __call__(self, func: Callable[_P, _R]) -> Callable[_P, _R]: ...

    def __call__(self, func: Callable[_P, Any]) -> Callable[_P, Any]:
        """Decorates ``func`` so that every call of it runs in a new session with these options.

        A new session per call, because each call of an agent function is its own run: sharing one
        would mix concurrent runs' turn counts and predictions.
        """
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_async(*args: _P.args, **kwargs: _P.kwargs) -> Any:
                async with self._fresh():
                    return await func(*args, **kwargs)

            return run_async

        @functools.wraps(func)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return run

    def _fresh(self) -> Session:
        return Session(self._requested_id, next_turn_seconds=self._initial_next_turn_seconds)


def session(session_id: str | None = None, *, next_turn_seconds: float | None = None) -> Session:
    """Starts an agent session: model calls made inside it are tagged for the agentkv router.

    ``session_id`` defaults to a random id. ``next_turn_seconds`` seeds the prediction of the
    tool step's duration before the session has measured one.

        with agentkv.session() as s:
            client.chat.completions.create(...)
            s.last_turn.kv_path
    """
    return Session(session_id, next_turn_seconds=next_turn_seconds)


def current_session() -> Session | None:
    """The innermost session active in this context (task or thread), if any."""
    stack = _active.get()
    return stack[-1] if stack else None
