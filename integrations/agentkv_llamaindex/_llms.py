"""LlamaIndex's OpenAI LLMs, sending through agentkv's tagged clients."""

from __future__ import annotations

import openai
from llama_index.llms.openai import OpenAI as LlamaOpenAI
from llama_index.llms.openai_like import OpenAILike as LlamaOpenAILike
from pydantic import Field

import agentkv

__all__ = ["OpenAI", "OpenAILike"]


class _AgentKVClients:
    """Wraps the openai clients a LlamaIndex LLM builds for itself (per call or reused)."""

    agentkv_body: bool

    def _get_client(self) -> openai.OpenAI:
        return agentkv.wrap(super()._get_client(), agentkv_body=self.agentkv_body)  # type: ignore[misc]

    def _get_aclient(self) -> openai.AsyncOpenAI:
        return agentkv.wrap(super()._get_aclient(), agentkv_body=self.agentkv_body)  # type: ignore[misc]


class OpenAI(_AgentKVClients, LlamaOpenAI):
    """``llama_index.llms.openai.OpenAI`` whose calls inside an agentkv session are tagged.

    Takes every argument the LlamaIndex class takes, plus ``agentkv_body`` (False: headers only).
    """

    agentkv_body: bool = Field(default=True, exclude=True)


class OpenAILike(_AgentKVClients, LlamaOpenAILike):
    """``llama_index.llms.openai_like.OpenAILike`` (vLLM and other OpenAI-compatible servers)
    whose calls inside an agentkv session are tagged."""

    agentkv_body: bool = Field(default=True, exclude=True)
