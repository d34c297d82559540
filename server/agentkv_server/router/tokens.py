"""How many of a turn's prompt tokens are new beyond the session's holding, and how many a
prompt no engine has counted is likely to have.

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

__all__ = ["PromptSizes", "count_prompt_tokens", "tokenize_body"]

# Prompt tokens per byte of a chat request body before any was measured: English text runs
# about four characters a token, and a body's JSON adds little to a long history.
_TOKENS_PER_BYTE = 0.25
# Weight of each measured prompt in the running ratio.
_RATIO_ALPHA = 0.1

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


class PromptSizes:
    """Prompt tokens per request byte, learned from the engines' answers.

    What P's queue expects a step to compute where no engine counted the prompt beforehand: a
    cold first turn has no holder to count it on, and its whole history is what makes P's
    queue long (docs/router.md, "P's queue").
    """

    __slots__ = ("tokens_per_byte",)

    def __init__(self, tokens_per_byte: float = _TOKENS_PER_BYTE) -> None:
        self.tokens_per_byte = tokens_per_byte

    def estimate(self, request: ClientRequest) -> int:
        return round(request.body_bytes * self.tokens_per_byte)

    def observe(self, request: ClientRequest, prompt_tokens: int) -> None:
        """``request``'s prompt came to ``prompt_tokens`` tokens on an engine."""
        if request.body_bytes > 0:
            ratio = prompt_tokens / request.body_bytes
            self.tokens_per_byte += _RATIO_ALPHA * (ratio - self.tokens_per_byte)
