"""LlamaIndex's OpenAI LLMs, sending through agentkv's tagging HTTP clients."""

from __future__ import annotations

from typing import Any

import openai
from llama_index.llms.openai import OpenAI as LlamaOpenAI
from llama_index.llms.openai_like import OpenAILike as LlamaOpenAILike
from pydantic import BaseModel, Field

import agentkv

__all__ = ["OpenAI", "OpenAILike"]


class _TaggingClients(BaseModel):
    """What both classes add to LlamaIndex's: ``agentkv_body``, and agentkv's tagging clients
    as the ``http_client`` / ``async_http_client`` LlamaIndex hands to every openai client it
    builds (reused or per call). Comes first in their bases, so its ``__init__`` runs first."""

    agentkv_body: bool = Field(default=True, exclude=True)
    """False sends agentkv's hints as headers only (for servers that reject unknown fields)."""

    def __init__(
        self,
        *args: Any,
        agentkv_body: bool = True,
        http_client: Any = None,
        async_http_client: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            *args,
            agentkv_body=agentkv_body,
            http_client=agentkv.http_client(
                http_client or openai.DefaultHttpxClient(), agentkv_body=agentkv_body
            ),
            async_http_client=agentkv.async_http_client(
                async_http_client or openai.DefaultAsyncHttpxClient(), agentkv_body=agentkv_body
            ),
            **kwargs,
        )


class OpenAI(_TaggingClients, LlamaOpenAI):
    """``llama_index.llms.openai.OpenAI`` whose calls inside an agentkv session are tagged.

    Takes every argument the LlamaIndex class takes, plus ``agentkv_body`` (False: headers only).
    Its ``http_client`` / ``async_http_client`` (yours, wrapped without being changed, or
    openai's defaults) are agentkv's tagging clients.
    """


class OpenAILike(_TaggingClients, LlamaOpenAILike):
    """``llama_index.llms.openai_like.OpenAILike`` (vLLM and other OpenAI-compatible servers)
    whose calls inside an agentkv session are tagged; arguments as :class:`OpenAI`."""
