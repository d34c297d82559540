"""Stream proxies: the caller iterates openai's own stream, agentkv watches the chunks go by.

Nothing is buffered: each chunk is handed on as soon as openai yields it. The turn is finalized
once, on exhaustion, on an error, or when the caller closes the stream (``with`` included).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from openai import AsyncStream, Stream
from typing_extensions import Self

from agentkv._proxy import Proxy

if TYPE_CHECKING:
    from agentkv._calls import ModelCall

__all__ = ["ObservedAsyncStream", "ObservedStream"]


class ObservedStream(Proxy[Stream[Any]]):
    """An ``openai.Stream`` that reports its chunks and its end to a :class:`ModelCall`."""

    def __init__(self, stream: Stream[Any], call: ModelCall) -> None:
        super().__init__(stream)
        self._agentkv_call = call

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Any:
        try:
            chunk = next(self.__wrapped__)
        except BaseException:
            self._agentkv_call.finish()
            raise
        self._agentkv_call.chunk(chunk)
        return chunk

    def close(self) -> None:
        self._agentkv_call.finish()
        self.__wrapped__.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ObservedAsyncStream(Proxy[AsyncStream[Any]]):
    """An ``openai.AsyncStream`` that reports its chunks and its end to a :class:`ModelCall`."""

    def __init__(self, stream: AsyncStream[Any], call: ModelCall) -> None:
        super().__init__(stream)
        self._agentkv_call = call

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        try:
            chunk = await self.__wrapped__.__anext__()
        except BaseException:
            self._agentkv_call.finish()
            raise
        self._agentkv_call.chunk(chunk)
        return chunk

    async def close(self) -> None:
        self._agentkv_call.finish()
        await self.__wrapped__.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
