"""HTTP clients that tag model calls made inside a session: agentkv's one choke point.

openai sends every request of every call path through its HTTP client's ``send``, and frameworks
take that client as a public argument (``http_client``...). So agentkv tags there: the client
returned by :func:`http_client` forwards everything to the httpx client it wraps, except that
``send`` tags model calls made inside a session (see ``agentkv._calls``) and reads their response
as it passes.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar, overload

import openai
from typing_extensions import Self

from agentkv._calls import ModelCall
from agentkv._proxy import Proxy
from agentkv._streams import observe_body

__all__ = ["async_http_client", "http_client", "is_tagging"]

_Client = TypeVar("_Client")


class _TaggingClient(Proxy[Any]):
    _agentkv_tagging: ClassVar[bool] = True

    def __init__(self, client: Any, *, agentkv_body: bool) -> None:
        super().__init__(client)
        self._agentkv_body = agentkv_body

    def _agentkv_start(self, request: Any) -> tuple[ModelCall, Any] | None:
        return ModelCall.start(request, send_body=self._agentkv_body)


class _SyncTaggingClient(_TaggingClient):
    def send(self, request: Any, *, stream: bool = False, **kwargs: Any) -> Any:
        started = self._agentkv_start(request)
        if started is None:
            return self.__wrapped__.send(request, stream=stream, **kwargs)
        call, tagged = started
        response = self.__wrapped__.send(tagged, stream=stream, **kwargs)
        _observe(call, response, body_read=not stream)
        return response

    def __enter__(self) -> Self:
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.__wrapped__.__exit__(*exc_info)


class _AsyncTaggingClient(_TaggingClient):
    async def send(self, request: Any, *, stream: bool = False, **kwargs: Any) -> Any:
        started = self._agentkv_start(request)
        if started is None:
            return await self.__wrapped__.send(request, stream=stream, **kwargs)
        call, tagged = started
        response = await self.__wrapped__.send(tagged, stream=stream, **kwargs)
        _observe(call, response, body_read=not stream)
        return response

    async def __aenter__(self) -> Self:
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.__wrapped__.__aexit__(*exc_info)


def _observe(call: ModelCall, response: Any, *, body_read: bool) -> None:
    # A response built from bytes (mock transports) arrives read even when streamed.
    body_read = body_read or response.is_stream_consumed
    call.responded(response, body_read=body_read)
    if not body_read and response.status_code < 400:
        observe_body(response, call)


@overload
def http_client(client: None = None, *, agentkv_body: bool = True) -> openai.DefaultHttpxClient: ...


@overload
def http_client(client: _Client, *, agentkv_body: bool = True) -> _Client: ...


def http_client(client: Any = None, *, agentkv_body: bool = True) -> Any:
    """An httpx client whose model calls inside an :func:`agentkv.session` are tagged.

    Wraps ``client`` (an ``httpx.Client``; default: a new ``openai.DefaultHttpxClient()``) without
    changing it, and passes ``isinstance`` checks for its class. Give it to any openai client or
    framework that takes an ``http_client``. ``agentkv_body=False`` sends the tags as headers only.
    A client that already tags comes back as is.
    """
    base = openai.DefaultHttpxClient() if client is None else client
    return base if is_tagging(base) else _SyncTaggingClient(base, agentkv_body=agentkv_body)


@overload
def async_http_client(
    client: None = None, *, agentkv_body: bool = True
) -> openai.DefaultAsyncHttpxClient: ...


@overload
def async_http_client(client: _Client, *, agentkv_body: bool = True) -> _Client: ...


def async_http_client(client: Any = None, *, agentkv_body: bool = True) -> Any:
    """The ``httpx.AsyncClient`` twin of :func:`http_client` (default: ``DefaultAsyncHttpxClient``)."""
    base = openai.DefaultAsyncHttpxClient() if client is None else client
    return base if is_tagging(base) else _AsyncTaggingClient(base, agentkv_body=agentkv_body)


def is_tagging(client: object) -> bool:
    """True for a client built by :func:`http_client` or :func:`async_http_client`."""
    return getattr(client, "_agentkv_tagging", False) is True
