"""``ChatOpenAI`` whose requests go through agentkv's tagging HTTP clients."""

from __future__ import annotations

from typing import Any

import langchain_openai
import openai
from pydantic import Field, model_validator

import agentkv

__all__ = ["ChatOpenAI", "http_clients"]


def http_clients(
    *,
    agentkv_body: bool = True,
    proxy: str | None = None,
    http_client: Any = None,
    http_async_client: Any = None,
) -> dict[str, Any]:
    """``http_client`` and ``http_async_client`` arguments that tag calls made in a session.

    For chat models LangChain builds itself: ``init_chat_model("openai:m", **http_clients())``.
    Your own clients are wrapped without being changed; missing ones are openai's defaults, with
    ``proxy`` (what ``openai_proxy`` would be: LangChain takes one or the other).
    """
    options = {} if proxy is None else {"proxy": proxy}
    sync = http_client or openai.DefaultHttpxClient(**options)
    async_ = http_async_client or openai.DefaultAsyncHttpxClient(**options)
    return {
        "http_client": agentkv.http_client(sync, agentkv_body=agentkv_body),
        "http_async_client": agentkv.async_http_client(async_, agentkv_body=agentkv_body),
    }


class ChatOpenAI(langchain_openai.ChatOpenAI):
    """``langchain_openai.ChatOpenAI`` that tags every model call made in an agentkv session.

    Takes every argument ``ChatOpenAI`` takes. Its ``http_client`` and ``http_async_client``
    (yours, wrapped without being changed, or openai's defaults) are agentkv's tagging clients
    (:func:`agentkv.http_client`), so every call path LangChain takes (``invoke``, ``stream``,
    ``bind_tools``, ``with_structured_output``, the Responses API) is tagged. A call belongs to the
    active session or, without one, to its LangGraph thread's (see
    :class:`agentkv_langchain.AgentKVCallbackHandler`); calls with neither are sent untagged.
    """

    agentkv_body: bool = Field(default=True, exclude=True)
    """False sends agentkv's hints as headers only (for servers that reject unknown fields)."""

    @model_validator(mode="before")
    @classmethod
    def _send_through_agentkv(cls, values: Any) -> Any:
        # Before ChatOpenAI's own validator builds the openai clients from these arguments.
        if not isinstance(values, dict):
            return values
        given = {key: values.get(key) for key in ("http_client", "http_async_client")}
        # LangChain refuses openai_proxy next to http clients: the proxy moves into ours.
        proxy = None if any(given.values()) else values.pop("openai_proxy", None)
        clients = http_clients(agentkv_body=values.get("agentkv_body", True), proxy=proxy, **given)
        return {**values, **clients}

    @property
    def _llm_type(self) -> str:
        """``openai-chat`` as sent through agentkv (tracing tells the two apart)."""
        return "agentkv-openai-chat"
