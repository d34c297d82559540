"""The router's front door: header limits and access control, before any route runs.

A plain ASGI middleware (not ``BaseHTTPMiddleware``, which costs a task per request on the hot
path). Every request passes it: a route added later is protected by default rather than by
remembering to call a check. The body limit is enforced where the body is read (intake.py),
since a streamed body has no length up front.

The HTTP server has parsed the headers before this runs, so these limits bound what the router
accepts, not what the server buffers: uvicorn's h11 parser caps a header block at 16 KiB
(``h11_max_incomplete_event_size``); its httptools parser bounds less. docs/security.md.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from agentkv_server.router.auth import AccessPolicy
from agentkv_server.router.errors import RouterError

__all__ = ["TENANT_STATE", "RequestGuard"]

TENANT_STATE = "tenant"
"""``request.state.tenant``: the caller's tenant id, or None (anonymous, operator, public)."""


class RequestGuard:
    """Refuses requests with too many or too large headers (431) or without access (401)."""

    def __init__(
        self, app: ASGIApp, *, policy: AccessPolicy, max_header_count: int, max_header_bytes: int
    ) -> None:
        self.app = app
        self._policy = policy
        self._max_count = max_header_count
        self._max_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_size(scope)
            tenant = self._policy.admit(scope["path"], Headers(scope=scope))
        except RouterError as refused:
            await refused.response()(scope, receive, send)
            return
        scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)

    def _check_size(self, scope: Scope) -> None:
        headers = scope["headers"]
        if len(headers) > self._max_count:
            raise _too_large(f"More than {self._max_count} request headers.")
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        size += sum(len(name) + len(value) for name, value in headers)
        if size > self._max_bytes:
            raise _too_large(f"Request target and headers exceed {self._max_bytes} bytes.")


def _too_large(message: str) -> RouterError:
    return RouterError(431, message, code="request_header_fields_too_large")
