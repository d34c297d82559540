"""The turn endpoints, served without FastAPI's routing layers.

A turn passes the header limits and access control (guard.py) and then goes straight to its
handler: no exception and exit-stack middlewares, no route matching over every route, no
dependency solving. Under load those layers took about a third of the router's CPU for a P/D
turn (docs/router.md, "Hot path"). Errors keep their shapes: a :class:`RouterError` becomes
its OpenAI-format response here, anything else goes on to the app's outermost handler
(errors.py), as it would from a FastAPI route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agentkv_server.router.errors import RouterError, error_response

__all__ = ["FastRoutes", "Handler"]

Handler = Callable[[Request], Awaitable[Response]]


class FastRoutes:
    """Serves ``POST`` on the given paths with their handlers (405 for other methods, as the
    FastAPI routes answered); every other path goes on to ``app``."""

    def __init__(self, app: ASGIApp, *, routes: Mapping[str, Handler]) -> None:
        self.app = app
        self._routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            response: Response = error_response(405, "Method Not Allowed")
        else:
            try:
                response = await handler(Request(scope, receive))
            except RouterError as refused:
                response = refused.response()
        await response(scope, receive, send)
