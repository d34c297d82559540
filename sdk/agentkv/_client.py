"""Drop-in OpenAI clients whose model calls carry agentkv's session tags.

Two ways in, one behaviour: :class:`OpenAI` / :class:`AsyncOpenAI` subclass openai's clients, and
:func:`wrap` copies a client built elsewhere (frameworks build their own). Both send through an
HTTP client from ``agentkv._http``, where every call path's model requests are tagged, and only
inside a session.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast, overload

import openai
from typing_extensions import Self

from agentkv import _http

__all__ = ["AsyncOpenAI", "OpenAI", "wrap"]

_ClientT = TypeVar("_ClientT", bound="openai.OpenAI | openai.AsyncOpenAI")


class OpenAI(openai.OpenAI):
    """``openai.OpenAI`` whose model calls inside an :func:`agentkv.session` are tagged.

    Takes every argument ``openai.OpenAI`` takes, plus ``agentkv_body``: False sends the tags as
    headers only, for servers that reject unknown body fields (api.openai.com). An
    ``http_client`` you pass is wrapped with :func:`agentkv.http_client`, not changed.
    """

    def __init__(self, *, agentkv_body: bool = True, http_client: Any = None, **kwargs: Any):
        self._agentkv_body = agentkv_body
        super().__init__(
            http_client=_http.http_client(http_client, agentkv_body=agentkv_body), **kwargs
        )

    def copy(self, **kwargs: Any) -> Self:
        """``openai.OpenAI.copy`` that keeps ``agentkv_body``."""
        return super().copy(**_keep_body_option(kwargs, self._agentkv_body))

    with_options = copy


class AsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` whose model calls inside an :func:`agentkv.session` are tagged.

    Takes every argument ``openai.AsyncOpenAI`` takes, plus ``agentkv_body`` (see :class:`OpenAI`).
    """

    def __init__(self, *, agentkv_body: bool = True, http_client: Any = None, **kwargs: Any):
        self._agentkv_body = agentkv_body
        super().__init__(
            http_client=_http.async_http_client(http_client, agentkv_body=agentkv_body),
            **kwargs,
        )

    def copy(self, **kwargs: Any) -> Self:
        """``openai.AsyncOpenAI.copy`` that keeps ``agentkv_body``."""
        return super().copy(**_keep_body_option(kwargs, self._agentkv_body))

    with_options = copy


@overload
def wrap(client: openai.OpenAI, *, agentkv_body: bool = True) -> openai.OpenAI: ...


@overload
def wrap(client: openai.AsyncOpenAI, *, agentkv_body: bool = True) -> openai.AsyncOpenAI: ...


def wrap(client: _ClientT, *, agentkv_body: bool = True) -> _ClientT:
    """Returns a copy of ``client`` whose model calls inside sessions are tagged.

    The copy is openai's own ``client.copy()`` (same class, options and connection pool) with its
    HTTP client wrapped by :func:`agentkv.http_client`; ``client`` itself is not changed. A client
    that already tags comes back as is (its calls are never tagged twice).
    """
    if not isinstance(client, (openai.OpenAI, openai.AsyncOpenAI)):
        raise TypeError(
            f"agentkv.wrap expects an openai.OpenAI or openai.AsyncOpenAI, got {client!r}"
        )
    # openai keeps the HTTP client in ``_client`` and offers no public getter; copy() shares it.
    current = client._client
    if _http.is_tagging(current):
        return client
    if isinstance(client, openai.AsyncOpenAI):
        tagging = _http.async_http_client(current, agentkv_body=agentkv_body)
    else:
        tagging = _http.http_client(current, agentkv_body=agentkv_body)
    return cast(_ClientT, client.copy(http_client=tagging))


def _keep_body_option(copy_kwargs: dict[str, Any], agentkv_body: bool) -> dict[str, Any]:
    # openai's copy() builds the new client with self.__class__(..., **_extra_kwargs).
    extra = {"agentkv_body": agentkv_body, **copy_kwargs.get("_extra_kwargs", {})}
    return {**copy_kwargs, "_extra_kwargs": extra}
