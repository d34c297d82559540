"""The choke point: ``create`` on the model-call resources, tagged inside a session.

Outside a session ``create`` is openai's own, untouched. Inside one, the call goes through
openai's public ``with_raw_response`` so the router's response headers can be read, and the caller
gets back exactly what openai's ``create`` returns (streams behind an observing proxy). Any
failure of agentkv's own bookkeeping is logged and the user's call goes on.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any, ParamSpec, Protocol, TypeVar

import openai

from agentkv._proxy import Proxy
from agentkv._results import finish_reason, kv_path, reused_tokens, server_timing
from agentkv._session import Session, TurnInfo, current_session
from agentkv._streams import ObservedAsyncStream, ObservedStream
from agentkv._tagging import TurnTags, is_tool_continuation, tag_request

__all__ = ["AsyncTaggedResource", "ModelCall", "TaggedChat", "TaggedResource", "tag_resource"]

logger = logging.getLogger("agentkv")

_P = ParamSpec("_P")
_R = TypeVar("_R")

_AnyClient = openai.OpenAI | openai.AsyncOpenAI
_R_co = TypeVar("_R_co", covariant=True)


class _RawResponse(Protocol[_R_co]):
    """What ``with_raw_response.create`` returns: the parsed result plus the HTTP headers."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def parse(self) -> _R_co: ...


def _shielded(method: Callable[_P, None]) -> Callable[_P, None]:
    """Bookkeeping that must never raise into the user's call: failures are logged instead."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            logger.exception("agentkv: %s failed; the call goes on untracked", method.__qualname__)

    return run


class ModelCall:
    """One model call inside a session, from its tags to the :class:`TurnInfo` it leaves."""

    def __init__(self, session: Session, tags: TurnTags) -> None:
        self._session = session
        self._tags = tags
        self._started_at = time.monotonic()
        self._first_chunk_at: float | None = None
        self._finish_reason: str | None = None
        self._headers: Mapping[str, str] = {}
        self._finished = False

    @classmethod
    def start(
        cls, kwargs: Mapping[str, Any], *, client: _AnyClient, send_body: bool
    ) -> tuple[ModelCall, dict[str, Any]] | None:
        """Tags a call in the current session; None (send it as is) without one or on failure."""
        session = current_session()
        if session is None:
            return None
        try:
            tags = session._start_turn(tool_continuation=is_tool_continuation(kwargs))
            tagged = tag_request(
                kwargs, tags, send_body=send_body, preset_headers=client.default_headers
            )
        except Exception:
            logger.exception("agentkv: could not tag a model call; sending it untagged")
            return None
        return cls(session, tags), tagged

    def result(self, raw: _RawResponse[_R]) -> _R:
        """What openai's ``create`` would have returned for ``raw``, observed on its way out."""
        parsed = raw.parse()
        try:
            return self._observe(raw.headers, parsed)
        except Exception:
            logger.exception("agentkv: could not observe a response; returning it untracked")
            return parsed

    def _observe(self, headers: Mapping[str, str], parsed: _R) -> _R:
        self._headers = headers
        if isinstance(parsed, openai.Stream):
            return ObservedStream(parsed, self)  # type: ignore[return-value]
        if isinstance(parsed, openai.AsyncStream):
            return ObservedAsyncStream(parsed, self)  # type: ignore[return-value]
        self._first_chunk_at = time.monotonic()
        self._finish_reason = finish_reason(parsed)
        self.finish()
        return parsed

    @_shielded
    def chunk(self, chunk: object) -> None:
        if self._first_chunk_at is None:
            self._first_chunk_at = time.monotonic()
        if reason := finish_reason(chunk):
            self._finish_reason = reason

    @_shielded
    def finish(self) -> None:
        """Records the turn once: on completion, exhaustion, error or close."""
        if self._finished:
            return
        self._finished = True
        ended_at = time.monotonic()
        ttft = None if self._first_chunk_at is None else self._first_chunk_at - self._started_at
        info = TurnInfo(
            turn=self._tags.turn,
            tool_continuation=self._tags.tool_continuation,
            session_end=self._tags.session_end,
            kv_path=kv_path(self._headers),
            reused_tokens=reused_tokens(self._headers),
            ttft_seconds=ttft,
            finish_reason=self._finish_reason,
            server_timing=server_timing(self._headers),
        )
        self._session._complete_turn(info, ended_at=ended_at)


class _Tagged(Proxy[Any]):
    def __init__(self, resource: Any, *, client: _AnyClient, send_body: bool) -> None:
        super().__init__(resource)
        self._agentkv_client = client
        self._agentkv_send_body = send_body

    def _agentkv_start(self, kwargs: Mapping[str, Any]) -> tuple[ModelCall, dict[str, Any]] | None:
        return ModelCall.start(
            kwargs, client=self._agentkv_client, send_body=self._agentkv_send_body
        )


class _ObservedRawResponse(Proxy[Any]):
    """openai's raw response, whose ``parse()`` returns the observed result."""

    def __init__(self, raw: _RawResponse[Any], call: ModelCall) -> None:
        super().__init__(raw)
        self._agentkv_call = call

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        return self._agentkv_call.result(self.__wrapped__)


class TaggedRawResource(_Tagged):
    """``<resource>.with_raw_response``: LangChain calls ``create`` through it."""

    def create(self, *args: Any, **kwargs: Any) -> Any:
        started = self._agentkv_start(kwargs)
        if started is None:
            return self.__wrapped__.create(*args, **kwargs)
        call, tagged = started
        return _ObservedRawResponse(self.__wrapped__.create(*args, **tagged), call)


class AsyncTaggedRawResource(_Tagged):
    """The async twin of :class:`TaggedRawResource`."""

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        started = self._agentkv_start(kwargs)
        if started is None:
            return await self.__wrapped__.create(*args, **kwargs)
        call, tagged = started
        return _ObservedRawResponse(await self.__wrapped__.create(*args, **tagged), call)


class TaggedResource(_Tagged):
    """A sync model-call resource (``chat.completions``, ``completions``, ``responses``)."""

    @cached_property
    def with_raw_response(self) -> TaggedRawResource:
        return TaggedRawResource(
            self.__wrapped__.with_raw_response,
            client=self._agentkv_client,
            send_body=self._agentkv_send_body,
        )

    def create(self, *args: Any, **kwargs: Any) -> Any:
        started = self._agentkv_start(kwargs)
        if started is None:
            return self.__wrapped__.create(*args, **kwargs)
        call, tagged = started
        return call.result(self.__wrapped__.with_raw_response.create(*args, **tagged))


class AsyncTaggedResource(_Tagged):
    """The async twin of :class:`TaggedResource`."""

    @cached_property
    def with_raw_response(self) -> AsyncTaggedRawResource:
        return AsyncTaggedRawResource(
            self.__wrapped__.with_raw_response,
            client=self._agentkv_client,
            send_body=self._agentkv_send_body,
        )

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        started = self._agentkv_start(kwargs)
        if started is None:
            return await self.__wrapped__.create(*args, **kwargs)
        call, tagged = started
        return call.result(await self.__wrapped__.with_raw_response.create(*args, **tagged))


class TaggedChat(_Tagged):
    """``client.chat``, whose ``completions`` is tagged."""

    @cached_property
    def completions(self) -> Any:
        return tag_resource(
            self.__wrapped__.completions,
            client=self._agentkv_client,
            send_body=self._agentkv_send_body,
        )


def tag_resource(resource: Any, *, client: _AnyClient, send_body: bool) -> _Tagged:
    """Wraps a model-call resource of ``client`` so that its ``create`` is tagged."""
    tagged_cls = AsyncTaggedResource if isinstance(client, openai.AsyncOpenAI) else TaggedResource
    return tagged_cls(resource, client=client, send_body=send_body)
