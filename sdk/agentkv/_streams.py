"""Response body streams that show each piece to a :class:`ModelCall` as it passes.

Nothing is buffered: each piece is handed on as soon as the transport yields it. The turn is
recorded once, when the body is exhausted, fails, or is closed (``with`` included). The classes
subclass the byte-stream bases of the HTTP library the response comes from (httpx, or httpx2 for
openai 3.x), which check the stream's type.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentkv._calls import ModelCall

__all__ = ["observe_body"]


def observe_body(response: Any, call: ModelCall) -> None:
    """Makes ``response`` (not read yet) feed its body to ``call`` as the caller reads it."""
    http = importlib.import_module(type(response).__module__.partition(".")[0])
    sync, async_ = _stream_classes(http)
    observed = sync if isinstance(response.stream, http.SyncByteStream) else async_
    response.stream = observed(response.stream, call)


@functools.cache
def _stream_classes(http: ModuleType) -> tuple[type, type]:
    class ObservedStream(http.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, stream: Any, call: ModelCall) -> None:
            self._stream = stream
            self._call = call

        def __iter__(self) -> Iterator[bytes]:
            try:
                for data in self._stream:
                    self._call.chunk(data)
                    yield data
            finally:
                self._call.finish()

        def close(self) -> None:
            self._call.finish()
            self._stream.close()

    class ObservedAsyncStream(http.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, stream: Any, call: ModelCall) -> None:
            self._stream = stream
            self._call = call

        async def __aiter__(self) -> AsyncIterator[bytes]:
            try:
                async for data in self._stream:
                    self._call.chunk(data)
                    yield data
            finally:
                self._call.finish()

        async def aclose(self) -> None:
            self._call.finish()
            await self._stream.aclose()

    return ObservedStream, ObservedAsyncStream
