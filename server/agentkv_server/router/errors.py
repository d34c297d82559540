"""Errors the router answers with, in OpenAI's format so that every OpenAI client can read them.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentkv_server.errors import AgentKVServerError

__all__ = [
    "ClientGone",
    "RouterError",
    "TurnTimedOut",
    "error_response",
    "install_error_handlers",
]

logger = logging.getLogger(__name__)


class RouterError(AgentKVServerError):
    """A request the router refuses or cannot serve; becomes an OpenAI-format error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return error_response(
            self.status,
            self.message,
            type=self.type,
            param=self.param,
            code=self.code,
            headers=self.headers,
        )


class TurnTimedOut(RouterError):
    """A turn that reached ``timeouts.first_token_s`` before its first token, in ``phase``
    (``queue``: held in the router; ``prefill`` or ``decode``: waiting for that engine). 504;
    its work is not repeated elsewhere, and no engine is blamed: a busy engine is not a dead
    one (docs/faults.md, "Busy is not dead")."""

    def __init__(self, phase: str, deadline_s: float, headers: Mapping[str, str]) -> None:
        where = {"queue": "waiting for a prefill engine"}.get(phase, f"in its {phase} step")
        super().__init__(
            504,
            f"The turn reached its deadline of {deadline_s:g} s to its first token {where}: "
            "the engines are busy. It was stopped, not retried elsewhere.",
            type="server_error",
            code="turn_timeout",
            headers={**headers, "x-should-retry": "false"},
        )
        self.phase = phase


class ClientGone(AgentKVServerError):
    """The client closed its connection before the router answered, while it sent its body
    (``phase`` ``body``) or waited for the turn (``turn``). A normal event: nobody is left to
    answer, so the router counts it and stops the turn's work (docs/security.md)."""

    def __init__(self, phase: str) -> None:
        super().__init__(f"the client left during its {phase}")
        self.phase = phase


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-format error response."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _router_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RouterError)
    return exc.response()


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    # FastAPI's own 404/405 would otherwise answer {"detail": ...}.
    assert isinstance(exc, StarletteHTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), type=kind)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not the client's fault: still an answer every OpenAI client can read.
    logger.exception("unexpected error serving %s %s", request.method, request.url.path)
    return error_response(500, "The router failed unexpectedly.", type="server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app answers OpenAI-shaped."""
    app.add_exception_handler(RouterError, _router_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
