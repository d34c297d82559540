"""What the stub engine reads and writes, per OpenAI endpoint, in vLLM's shapes.

Chat completions (``messages``), completions (``prompt``) and the Responses API (``input``) differ
in their prompt, their output limit, their answer and usage names, and their stream: chat and
completion chunks end with ``data: [DONE]``; a Responses stream is named events ending with
``response.completed``, whose response carries ``kv_transfer_params`` as vLLM's does.

A non-streamed request with a JSON-schema format (chat ``response_format``, Responses
``text.format``) is answered with a sample object of the schema and a finished status, as vLLM's
structured outputs would constrain a model to: what openai's ``parse`` helpers and LangChain's
``with_structured_output`` need to accept the answer.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from agentkv_server import wire

__all__ = [
    "answer_body",
    "count_prompt_tokens",
    "invalid_body",
    "output_limit",
    "stream_events",
    "structured_answer",
    "stub_answer",
]

MAX_TOKENS = 4096
OUTPUT_TOKEN_ID = 100_000
"""The id of the stub's answer word ``w{i}`` is ``OUTPUT_TOKEN_ID + i``."""
PROMPT_TOKEN_ID = 1_000
"""The id of a text prompt's ``i``-th word."""
"""The stub model's context: larger output limits are refused (400), as vLLM does."""
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _is_responses(body: dict[str, Any]) -> bool:
    return "input" in body


def invalid_body(body: dict[str, Any]) -> str | None:
    """Why vLLM would refuse ``body`` with a 400 (the parts the stub reads), or None."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            return "messages must be a list of objects with a 'role'"
    elif _is_responses(body):
        if not isinstance(body["input"], (str, list)):
            return "input must be a string or a list of items"
    elif not isinstance(body.get("prompt"), (str, list)):
        return "prompt must be a string or a list"
    for name in _LIMIT_FIELDS:
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TOKENS
        ):
            return f"{name} must be an integer in [1, {MAX_TOKENS}]"
    params = body.get(wire.KV_TRANSFER_PARAMS)
    if params is not None and not isinstance(params, dict):
        return "kv_transfer_params must be an object"
    return None


def output_limit(body: dict[str, Any]) -> int:
    """Tokens a decode step generates: the request's limit, 8 without one."""
    return int(next((body[name] for name in _LIMIT_FIELDS if body.get(name)), 8))


def count_prompt_tokens(body: dict[str, Any]) -> int:
    """The stub's tokenizer: words, plus two per chat message (or Responses item, instructions
    included) for the template."""
    if "messages" in body:
        return sum(2 + len(str(m.get("content") or "").split()) for m in body["messages"])
    if _is_responses(body):
        items = body["input"] if isinstance(body["input"], list) else [body["input"]]
        texts = [_item_text(item) for item in items]
        if body.get("instructions"):
            texts.append(str(body["instructions"]))
        return sum(2 + len(text.split()) for text in texts)
    prompt = body.get("prompt", "")
    return len(prompt.split()) if isinstance(prompt, str) else len(prompt)


def _item_text(item: object) -> str:
    """A Responses input item's words: a message's content, a tool call's or its output's."""
    if not isinstance(item, dict):
        return str(item)
    content = item.get("content", item.get("output", item.get("arguments", "")))
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def stub_answer(max_tokens: int) -> str:
    """What a stub engine generates for any prompt: ``max_tokens`` words."""
    return "".join(f"w{index} " for index in range(max_tokens))


def structured_answer(body: dict[str, Any]) -> str | None:
    """The JSON a request's JSON-schema format asks for (a sample of the schema), or None."""
    if _is_responses(body):
        spec = (body.get("text") or {}).get("format") or {}
        schema = spec.get("schema")
    else:
        spec = body.get("response_format") or {}
        schema = (spec.get("json_schema") or {}).get("schema")
    if spec.get("type") != "json_schema" or not isinstance(schema, dict):
        return None
    return json.dumps(_sample(schema, schema.get("$defs") or {}))


_SAMPLE_BY_TYPE: dict[str, Any] = {"integer": 2, "number": 2.5, "string": "w0", "boolean": True}


def _sample(schema: dict[str, Any], defs: dict[str, Any]) -> Any:
    """A value that fits ``schema`` (the subset pydantic models and strict tools produce)."""
    if "$ref" in schema:
        return _sample(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return _sample(schema["anyOf"][0], defs)
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties") or {}
        return {name: _sample(value, defs) for name, value in properties.items()}
    if kind == "array":
        return []
    return _SAMPLE_BY_TYPE.get(kind)


def answer_body(
    body: dict[str, Any],
    text: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached: int | None,
    kv_transfer_params: dict[str, Any] | None = None,
    *,
    finished: bool = False,
) -> dict[str, Any]:
    """A non-streamed answer; ``cached`` None leaves the cached-token count out of its usage.
    ``finished``: the model stopped by itself, not at its output limit."""
    if _is_responses(body):
        answer = _response(body, text, prompt_tokens, completion_tokens, cached, finished)
    else:
        answer = _completion(body, text, prompt_tokens, completion_tokens, cached, finished)
    if kv_transfer_params is not None:
        answer[wire.KV_TRANSFER_PARAMS] = kv_transfer_params
    return answer


def answered_already(body: dict[str, Any]) -> int:
    """Words of the stub's answer the request already holds, which it continues after: a
    completion prompt's trailing output ids, or chat's final assistant message when it is
    continued (``continue_final_message``). A continued answer is the uninterrupted one."""
    if "messages" in body:
        messages = body["messages"]
        if body.get("continue_final_message") and messages[-1].get("role") == "assistant":
            return len(str(messages[-1].get("content") or "").split())
        return 0
    prompt = body.get("prompt")
    return len(prompt) - _first_output(prompt) if isinstance(prompt, list) else 0


def _first_output(prompt: list[Any]) -> int:
    """Where the trailing run of the stub's own output ids (``OUTPUT_TOKEN_ID + i``) starts."""
    start = len(prompt)
    while start and isinstance(prompt[start - 1], int) and prompt[start - 1] >= OUTPUT_TOKEN_ID:
        start -= 1
    return start


def prompt_token_ids(body: dict[str, Any]) -> list[int]:
    """A completion prompt's ids: its own list, or one id per word of its text."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return [t for t in prompt if isinstance(t, int)]
    return [PROMPT_TOKEN_ID + index for index, _ in enumerate(str(prompt).split())]


def stream_events(
    body: dict[str, Any], n: int, prompt_tokens: int, kv_transfer_params: dict[str, Any] | None
) -> list[bytes]:
    """A streamed answer of ``n`` words, one SSE event per element, ending as vLLM's does."""
    if not _is_responses(body):
        start, stream_id = answered_already(body), f"stream-{uuid.uuid4().hex}"
        chunks = [
            _stream_chunk(body, start + index, "length" if index == n - 1 else None)
            for index in range(n)
        ]
        if body.get("return_token_ids") and "prompt" in body and chunks:
            chunks[0]["choices"][0]["prompt_token_ids"] = prompt_token_ids(body)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
            usage["total_tokens"] = prompt_tokens + n
            chunks.append({**_stream_chunk(body, 0, None), "choices": [], "usage": usage})
        for chunk in chunks:
            chunk["id"] = stream_id
        compact = (",", ":")  # as vLLM writes chunks
        return [
            b"data: " + json.dumps(c, separators=compact).encode() + b"\n\n" for c in chunks
        ] + [b"data: [DONE]\n\n"]
    final = _response(body, stub_answer(n), prompt_tokens, n, 0)
    final[wire.KV_TRANSFER_PARAMS] = kv_transfer_params
    started = {**final, "status": "in_progress", "output": [], "usage": None}
    started[wire.KV_TRANSFER_PARAMS] = None
    events: list[tuple[str, dict[str, Any]]] = [("response.created", {"response": started})]
    events += [("response.output_text.delta", {"delta": f"w{i} "}) for i in range(n)]
    events.append(("response.completed", {"response": final}))
    return [
        f"event: {name}\ndata: ".encode()
        + json.dumps({"type": name, "sequence_number": number, **data}).encode()
        + b"\n\n"
        for number, (name, data) in enumerate(events)
    ]


def _completion(
    body: dict[str, Any],
    text: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached: int | None,
    finished: bool = False,
) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if "messages" in body:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice, kind, prefix = (
            {"index": 0, "text": text, "logprobs": None},
            "text_completion",
            "cmpl",
        )
    choice["finish_reason"] = "stop" if finished else "length"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [choice],
        "usage": usage,
    }


def _response(
    body: dict[str, Any],
    text: str,
    prompt_tokens: int,
    output_tokens: int,
    cached: int | None,
    finished: bool = False,
) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "total_tokens": prompt_tokens + output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    if cached is not None:
        usage["input_tokens_details"] = {"cached_tokens": cached}
    content = [{"type": "output_text", "text": text, "annotations": []}]
    message = {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "role": "assistant",
        "status": "completed",
        "content": content,
    }
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "status": "completed" if finished else "incomplete",
        "incomplete_details": None if finished else {"reason": "max_output_tokens"},
        "output": [message],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def _stream_chunk(body: dict[str, Any], word: int, finish_reason: str | None) -> dict[str, Any]:
    """The chunk of the answer's word ``w{word}``."""
    text = f"w{word} "
    if "messages" in body:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
        kind = "chat.completion.chunk"
    else:
        choice, kind = {"index": 0, "text": text, "logprobs": None}, "text_completion"
        choice["prompt_token_ids"] = None
        choice["token_ids"] = [OUTPUT_TOKEN_ID + word] if body.get("return_token_ids") else None
    choice["finish_reason"] = finish_reason
    return {
        "id": "stream",
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [choice],
    }
