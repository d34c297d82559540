"""LlamaIndex's OpenAI LLMs, sending through agentkv's tagging HTTP clients."""

from __future__ import annotations

from typing import Any

import openai
from llama_index.llms.openai import OpenAI as LlamaOpenAI
from llama_index.llms.openai_like import OpenAILike as LlamaOpenAILike
from pydantic import Field

import agentkv

__all__ = ["OpenAI", "OpenAILike"]


def _tagging_clients(
    http_client: Any, async_http_client: Any, *, agentkv_body: bool
) -> dict[str, Any]:
    # LlamaIndex hands these to every openai client it builds (reused or per call).
    return {
        "http_client": agentkv.http_client(
            http_client or openai.DefaultHttpxClient(), agentkv_body=agentkv_body
        ),
        "async_http_client": agentkv.async_http_client(
            async_http_client or openai.DefaultAsyncHttpxClient(), agentkv_body=agentkv_body
        ),
    }


class OpenAI(LlamaOpenAI):
    """``llama_index.llms.openai.OpenAI`` whose calls inside an agentkv session are tagged.

    Takes every argument the LlamaIndex class takes, plus ``agentkv_body`` (False: headers only).
    Its ``http_client`` / ``async_http_client`` (yours, wrapped without being changed, or
    openai's defaults) are agentkv's tagging clients.
    """

    agentkv_body: bool = Field(default=True, exclude=True)

    def __init__(
        self,
        *args: Any,
        agentkv_body: bool = True,
        http_client: Any = None,
        async_http_client: Any = None,
        **kwargs: Any,
    ) -> None:
        clients = _tagging_clients(http_client, async_http_client, agentkv_body=agentkv_body)
        super().__init__(*args, agentkv_body=agentkv_body, **clients, **kwargs)


class OpenAILike(LlamaOpenAILike):
    """``llama_index.llms.openai_like.OpenAILike`` (vLLM and other OpenAI-compatible servers)
    whose calls inside an agentkv session are tagged; arguments as :class:`OpenAI`."""

    agentkv_body: bool = Field(default=True, exclude=True)

    def __init__(
        self,
        *args: Any,
        agentkv_body: bool = True,
        http_client: Any = None,
        async_http_client: Any = None,
        **kwargs: Any,
    ) -> None:
        clients = _tagging_clients(http_client, async_http_client, agentkv_body=agentkv_body)
        super().__init__(*args, agentkv_body=agentkv_body, **clients, **kwargs)
