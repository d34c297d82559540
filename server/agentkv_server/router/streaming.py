"""A streamed answer relayed to the client, and stopped as soon as the client goes away; and a
turn's work before its answer, stopped the same way (:func:`unless_client_leaves`).

Starlette's ``StreamingResponse`` watches for the client's disconnect with an anyio task group
per stream (a cancel scope and two tasks); with it, a streamed turn cost the router about half
again as much CPU (docs/router.md, "Hot path"). Here one plain task waits for the disconnect and
cancels the relay, whose cleanup closes the engine's stream: vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from agentkv_server.router.errors import ClientGone

__all__ = ["RelayResponse", "unless_client_leaves"]


async def unless_client_leaves(receive: Receive, serving: Awaitable[Response]) -> Response:
    """``serving``'s response, awaited in this task; :class:`ClientGone` (``turn``) once the
    client closes its connection first. Its body must have been read: what ``receive`` says
    next is the disconnect. The turn's work is cancelled where it stands: a step held in the
    router's queue leaves it unsent, an engine call in flight closes its connection, and vLLM
    aborts a request whose connection closes."""
    watch = _ClientWatch(receive)
    try:
        response = await serving
    except asyncio.CancelledError:
        if not watch.left:
            raise
        watch.take_back_cancel()
        raise ClientGone("turn") from None
    finally:
        watch.stop()
    if watch.left:  # the turn's work ended as the client left: nobody to answer
        watch.take_back_cancel()
        raise ClientGone("turn")
    return response


class _ClientWatch:
    """Cancels the current task when the client disconnects (one plain task reading
    ``receive``); ``left`` says whether it did."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.left = False
        self._task = task
        self._watcher = asyncio.ensure_future(_on_disconnect(receive, self._client_left))

    def _client_left(self) -> None:
        self.left = True
        self._task.cancel()

    def take_back_cancel(self) -> None:
        """Withdraw the cancel this watch requested, so that the task goes on cleanly."""
        if sys.version_info >= (3, 11):
            self._task.uncancel()

    def stop(self) -> None:
        """Stop watching: call before any await in cleanup, which a disconnect must not
        cancel."""
        self._watcher.cancel()


class RelayResponse(Response):
    """Sends ``chunks`` as they come; closes the generator when done or when the client left."""

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        *,
        media_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = _ClientWatch(receive)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.left:
                raise
            watch.take_back_cancel()
        finally:
            watch.stop()
            await self.chunks.aclose()


async def _on_disconnect(receive: Receive, then: Callable[[], None]) -> None:
    # After the response completes, uvicorn answers http.disconnect too; by then the watcher
    # has been cancelled.
    while (await receive())["type"] != "http.disconnect":
        pass
    then()
