"""How many of a turn's prompt tokens are new beyond the session's holding.

The router asks the holder itself (vLLM's ``POST /tokenize``, which applies the same chat
template and tokenizer as the completion will): exact, and it costs the router no tokenizer
of its own. The holder's API server tokenizes in its own process, so the engine core's decode
loop is not stalled by it. It also proves the holder answers, which planning needs anyway.
docs/router.md ("Counting the new part") has the measured cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentkv_server.router.http_client import HTTPClient, Timeout
from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.placement import Engine
from agentkv_server.router.upstream import post_json

__all__ = ["count_prompt_tokens", "tokenize_body"]

# Request fields that change what the chat template renders.
_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)


def tokenize_body(request: ClientRequest) -> dict[str, Any]:
    """The ``/tokenize`` request that renders the same prompt as ``request``."""
    body = request.body
    fields = _CHAT_FIELDS if request.endpoint == "chat" else ("prompt",)
    return {"model": request.model} | {name: body[name] for name in fields if name in body}


async def count_prompt_tokens(
    http: HTTPClient,
    engine: Engine,
    request: ClientRequest,
    headers: Mapping[str, str],
    timeout: Timeout,
) -> int | None:
    """The prompt's token count as ``engine`` tokenizes it; None if it gives none.

    Raises EngineFailure when the engine cannot be reached or answers an error.
    """
    prompt = request.body.get("prompt")
    if request.endpoint == "completion" and isinstance(prompt, list):
        return len(prompt) if all(isinstance(token, int) for token in prompt) else None
    answer = await post_json(http, engine, "/tokenize", tokenize_body(request), headers, timeout)
    count = answer.get("count")
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None
