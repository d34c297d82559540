"""Drop-in OpenAI clients whose model calls carry agentkv's session tags.

Two ways in, one behaviour: :class:`OpenAI` / :class:`AsyncOpenAI` subclass openai's clients, and
:func:`wrap` puts a forwarding proxy around a client built elsewhere (frameworks build their own).
Only ``chat.completions``, ``completions`` and ``responses`` change, and only inside a session.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar, TypeVar, cast, overload

import openai
from openai.resources import AsyncCompletions, Completions
from openai.resources.chat import AsyncChat, Chat
from openai.resources.responses import AsyncResponses, Responses
from typing_extensions import Self

from agentkv._calls import TaggedChat, tag_resource
from agentkv._proxy import Proxy

__all__ = ["AsyncOpenAI", "OpenAI", "wrap"]

_ClientT = TypeVar("_ClientT", bound="openai.OpenAI | openai.AsyncOpenAI")


class OpenAI(openai.OpenAI):
    """``openai.OpenAI`` whose model calls inside an :func:`agentkv.session` are tagged.

    Takes every argument ``openai.OpenAI`` takes, plus ``agentkv_body``: False sends the tags as
    headers only, for servers that reject unknown body fields (api.openai.com).
    """

    _agentkv_tagged: ClassVar[bool] = True

    def __init__(self, *, agentkv_body: bool = True, **kwargs: Any) -> None:
        self._agentkv_body = agentkv_body
        super().__init__(**kwargs)

    @cached_property
    def chat(self) -> Chat:
        return cast(Chat, TaggedChat(super().chat, client=self, send_body=self._agentkv_body))

    @cached_property
    def completions(self) -> Completions:
        tagged = tag_resource(super().completions, client=self, send_body=self._agentkv_body)
        return cast(Completions, tagged)

    @cached_property
    def responses(self) -> Responses:
        tagged = tag_resource(super().responses, client=self, send_body=self._agentkv_body)
        return cast(Responses, tagged)

    def copy(self, **kwargs: Any) -> Self:
        """``openai.OpenAI.copy`` that keeps ``agentkv_body``."""
        return super().copy(**_keep_body_option(kwargs, self._agentkv_body))

    with_options = copy


class AsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` whose model calls inside an :func:`agentkv.session` are tagged.

    Takes every argument ``openai.AsyncOpenAI`` takes, plus ``agentkv_body`` (see :class:`OpenAI`).
    """

    _agentkv_tagged: ClassVar[bool] = True

    def __init__(self, *, agentkv_body: bool = True, **kwargs: Any) -> None:
        self._agentkv_body = agentkv_body
        super().__init__(**kwargs)

    @cached_property
    def chat(self) -> AsyncChat:
        return cast(AsyncChat, TaggedChat(super().chat, client=self, send_body=self._agentkv_body))

    @cached_property
    def completions(self) -> AsyncCompletions:
        tagged = tag_resource(super().completions, client=self, send_body=self._agentkv_body)
        return cast(AsyncCompletions, tagged)

    @cached_property
    def responses(self) -> AsyncResponses:
        tagged = tag_resource(super().responses, client=self, send_body=self._agentkv_body)
        return cast(AsyncResponses, tagged)

    def copy(self, **kwargs: Any) -> Self:
        """``openai.AsyncOpenAI.copy`` that keeps ``agentkv_body``."""
        return super().copy(**_keep_body_option(kwargs, self._agentkv_body))

    with_options = copy


class _WrappedClient(Proxy[Any]):
    """A client built elsewhere, with its model calls tagged; everything else is forwarded."""

    _agentkv_tagged: ClassVar[bool] = True

    def __init__(self, client: openai.OpenAI | openai.AsyncOpenAI, *, agentkv_body: bool) -> None:
        super().__init__(client)
        self._agentkv_body = agentkv_body

    @cached_property
    def chat(self) -> Any:
        return TaggedChat(
            self.__wrapped__.chat, client=self.__wrapped__, send_body=self._agentkv_body
        )

    @cached_property
    def completions(self) -> Any:
        return self._agentkv_tag("completions")

    @cached_property
    def responses(self) -> Any:
        return self._agentkv_tag("responses")

    def copy(self, **kwargs: Any) -> Any:
        return wrap(self.__wrapped__.copy(**kwargs), agentkv_body=self._agentkv_body)

    with_options = copy

    def _agentkv_tag(self, name: str) -> Any:
        resource = getattr(self.__wrapped__, name)
        return tag_resource(resource, client=self.__wrapped__, send_body=self._agentkv_body)


@overload
def wrap(client: openai.OpenAI, *, agentkv_body: bool = True) -> openai.OpenAI: ...


@overload
def wrap(client: openai.AsyncOpenAI, *, agentkv_body: bool = True) -> openai.AsyncOpenAI: ...


def wrap(client: _ClientT, *, agentkv_body: bool = True) -> _ClientT:
    """Returns ``client`` with its model calls tagged inside sessions; ``client`` is not changed.

    The result forwards every other attribute to ``client`` and passes ``isinstance`` checks for
    its class. A client that is already tagged comes back as is (its calls are never tagged twice).
    """
    if getattr(client, "_agentkv_tagged", False):
        return client
    if not isinstance(client, (openai.OpenAI, openai.AsyncOpenAI)):
        raise TypeError(
            f"agentkv.wrap expects an openai.OpenAI or openai.AsyncOpenAI, got {client!r}"
        )
    return cast(_ClientT, _WrappedClient(client, agentkv_body=agentkv_body))


def _keep_body_option(copy_kwargs: dict[str, Any], agentkv_body: bool) -> dict[str, Any]:
    # openai's copy() builds the new client with self.__class__(..., **_extra_kwargs).
    extra = {"agentkv_body": agentkv_body, **copy_kwargs.get("_extra_kwargs", {})}
    return {**copy_kwargs, "_extra_kwargs": extra}
