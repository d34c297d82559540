"""``ChatOpenAI`` whose requests go through agentkv's tagged clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import langchain_openai
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import Field, model_validator
from typing_extensions import Self

import agentkv
from agentkv_langchain._threads import active, session_for_run

__all__ = ["ChatOpenAI"]

_RunManager = CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun


class ChatOpenAI(langchain_openai.ChatOpenAI):
    """``langchain_openai.ChatOpenAI`` that tags every model call for the agentkv router.

    Takes every argument ``ChatOpenAI`` takes. The openai clients it builds are wrapped with
    :func:`agentkv.wrap`, and each call runs in the active agentkv session or, when there is none,
    in the session of its LangGraph thread (:func:`agentkv_langchain.thread_session`). Calls made
    with neither are sent untagged.
    """

    agentkv_body: bool = Field(default=True, exclude=True)
    """False sends agentkv's hints as headers only (for servers that reject unknown fields)."""

    @model_validator(mode="after")
    def _send_through_agentkv(self) -> Self:
        # Runs after ChatOpenAI's own validator has built the clients from the user's arguments.
        if self.root_client is not None:
            self.root_client = agentkv.wrap(self.root_client, agentkv_body=self.agentkv_body)
            self.client = self.root_client.chat.completions
        if self.root_async_client is not None:
            self.root_async_client = agentkv.wrap(
                self.root_async_client, agentkv_body=self.agentkv_body
            )
            self.async_client = self.root_async_client.chat.completions
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with active(_session(run_manager)):
            return super()._generate(messages, stop, run_manager, **kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with active(_session(run_manager)):
            return await super()._agenerate(messages, stop, run_manager, **kwargs)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        session = _session(run_manager)
        chunks = super()._stream(messages, stop, run_manager, **kwargs)
        # Enter the session around each step, not across yields: the consumer may close this
        # generator from another context, where leaving the session would fail.
        while True:
            with active(session):
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        session = _session(run_manager)
        chunks = super()._astream(messages, stop, run_manager, **kwargs)
        while True:
            with active(session):
                chunk = await anext(chunks, None)
            if chunk is None:
                return
            yield chunk


def _session(run_manager: _RunManager | None) -> agentkv.Session | None:
    return session_for_run(run_manager.metadata if run_manager is not None else None)
