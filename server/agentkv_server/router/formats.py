"""What differs between the OpenAI endpoints the router serves, and nothing else.

Chat completions, completions and the Responses API run the same turn (orchestrator/); they
differ in their path, their required fields, how a one-token prefill step is asked for, where
usage names the prompt's and the cached tokens, and how a stream ends. The Responses API is
served stateless (docs/router.md, "The Responses API"): fields that need responses stored on
the server are refused before any engine sees them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agentkv_server import wire
from agentkv_server.router.errors import RouterError

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "OUTPUT_LIMIT_FIELDS",
    "Endpoint",
    "PromptUsage",
    "StreamEditor",
    "WireFormat",
    "invalid_parameter",
    "missing_parameter",
    "wire_format",
]

Endpoint = Literal["chat", "completion", "responses"]

# Fields that make no sense for a one-token prefill step (min_tokens > 1 would even be refused).
_PREFILL_DROPPED = ("stream_options", "min_tokens")
# Where chat and completions bodies bound the answer's length, and the bound completions have
# when neither is given (OpenAI's and vLLM's default for /v1/completions).
OUTPUT_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_SSE_DONE = b"data: [DONE]"
# The Responses API's last streamed event; vLLM puts the decode step's kv_transfer_params in it.
_RESPONSES_FINAL_EVENTS = frozenset(
    {b"response.completed", b"response.incomplete", b"response.failed"}
)
# Stateful Responses fields: they name responses or conversations stored on a server.
_STATEFUL_FIELDS = {
    "previous_response_id": "a response stored on the server",
    "conversation": "a conversation stored on the server",
}


@dataclass(frozen=True)
class PromptUsage:
    """A prefill step's prompt tokens and how many of them the engine did not compute."""

    prompt_tokens: int | None
    cached_tokens: int | None


class StreamEditor(Protocol):
    """Passes a decode stream on, and finds its final part (which the router holds back until
    the turn's holding is recorded: the client sends its next turn as soon as it sees it)."""

    kv_transfer_params: dict[str, Any] | None
    """The decode step's params, when the stream itself carried them (removed from it)."""
    ended: bool
    """The stream's final part has arrived (a stream that stops before it broke)."""

    def feed(self, chunk: bytes) -> tuple[bytes, bytes | None]:
        """(what to send on now, the stream's final part once it has arrived)."""

    def flush(self) -> bytes:
        """What is left when the engine's stream ends."""


class WireFormat(Protocol):
    endpoint: Endpoint
    path: str
    dropped_fields: tuple[str, ...]
    """Client fields the router consumes: engines never see them."""

    def check(self, body: dict[str, Any]) -> None:
        """Raise RouterError (400) naming what is wrong with ``body``."""

    def prefill_body(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The body of a one-token, non-streamed prefill step carrying ``params``."""

    def output_limit(self, body: dict[str, Any]) -> int | None:
        """The most tokens the answer may have (None: only the model's context bounds it)."""

    def prompt_usage(self, answer: dict[str, Any]) -> PromptUsage: ...

    def stream_editor(self) -> StreamEditor: ...


def missing_parameter(param: str, what: str) -> RouterError:
    return RouterError(
        400,
        f"'{param}' is required and must be {what}.",
        param=param,
        code="missing_required_parameter",
    )


def invalid_parameter(param: str, why: str) -> RouterError:
    return RouterError(400, f"Invalid '{param}': {why}.", param=param, code="invalid_value")


class _DoneSplitter:
    """Chat and completion streams end with ``data: [DONE]``; vLLM streams no params."""

    def __init__(self) -> None:
        self.kv_transfer_params: dict[str, Any] | None = None
        self.ended = False

    def feed(self, chunk: bytes) -> tuple[bytes, bytes | None]:
        head, done, tail = chunk.partition(_SSE_DONE)
        if not done:
            return chunk, None
        self.ended = True
        return head, done + tail

    def flush(self) -> bytes:
        return b""


class _ResponsesStreamEditor:
    """Responses streams end with a ``response.completed`` event whose response carries the
    decode step's ``kv_transfer_params``: taken out here, as from a non-streamed answer. Events
    are passed on whole (a chunk may end inside one)."""

    def __init__(self) -> None:
        self.kv_transfer_params: dict[str, Any] | None = None
        self.ended = False
        self._pending = b""

    def feed(self, chunk: bytes) -> tuple[bytes, bytes | None]:
        events, separator, self._pending = (self._pending + chunk).rpartition(b"\n\n")
        if not separator:  # no event complete yet: all of it is pending
            return b"", None
        whole = [event + separator for event in events.split(separator)]
        for index, event in enumerate(whole):
            if _event_name(event) in _RESPONSES_FINAL_EVENTS:
                self.ended = True
                final = [self._edit_final(event), *whole[index + 1 :], self._pending]
                self._pending = b""
                return b"".join(whole[:index]), b"".join(final)
        return b"".join(whole), None

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _edit_final(self, event: bytes) -> bytes:
        lines = event.removesuffix(b"\n\n").split(b"\n")
        for index, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                data = json.loads(line[5:])
            except ValueError:
                return event
            response = data.get("response") if isinstance(data, dict) else None
            if not isinstance(response, dict):
                return event
            params = response.pop(wire.KV_TRANSFER_PARAMS, None)
            if isinstance(params, dict):
                self.kv_transfer_params = params
            lines[index] = b"data: " + json.dumps(data, separators=(",", ":")).encode()
        return b"\n".join(lines) + b"\n\n"


def _event_name(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip()
    return None


def _check_common(body: dict[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise missing_parameter("model", "a non-empty string")
    if not isinstance(body.get("stream", False), bool):
        raise invalid_parameter("stream", "must be a boolean")


def _completions_usage(answer: dict[str, Any]) -> PromptUsage:
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return PromptUsage(_int_or_none(usage.get("prompt_tokens")), _int_or_none(cached))


def _completions_prefill(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    prefill = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    prefill.update(stream=False, max_tokens=1, kv_transfer_params=params)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


@dataclass(frozen=True)
class _Completions:
    """``/v1/chat/completions`` (``messages``) and ``/v1/completions`` (``prompt``)."""

    endpoint: Endpoint
    path: str
    prompt_field: str
    prompt_kind: str
    dropped_fields: tuple[str, ...] = ()

    def check(self, body: dict[str, Any]) -> None:
        _check_common(body)
        prompt = body.get(self.prompt_field)
        allowed = (list,) if self.endpoint == "chat" else (str, list)
        if not isinstance(prompt, allowed) or not prompt:
            raise missing_parameter(self.prompt_field, self.prompt_kind)

    def prefill_body(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        return _completions_prefill(body, params)

    def output_limit(self, body: dict[str, Any]) -> int | None:
        limits = [_positive_or_none(body.get(name)) for name in OUTPUT_LIMIT_FIELDS]
        given = [limit for limit in limits if limit is not None]
        if given:
            return min(given)
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.endpoint == "completion" else None

    def prompt_usage(self, answer: dict[str, Any]) -> PromptUsage:
        return _completions_usage(answer)

    def stream_editor(self) -> StreamEditor:
        return _DoneSplitter()


class _Responses:
    """``/v1/responses``, stateless: ``input`` and ``instructions`` carry the whole history."""

    endpoint: Endpoint = "responses"
    path = "/v1/responses"
    # The router stores no responses; an engine asked to would keep every one (vLLM never
    # evicts its store), so ``store`` stops here.
    dropped_fields = ("store",)

    def check(self, body: dict[str, Any]) -> None:
        _check_common(body)
        prompt = body.get("input")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise missing_parameter("input", "a non-empty string or list of items")
        for name, what in _STATEFUL_FIELDS.items():
            if body.get(name) is not None:
                raise RouterError(
                    400,
                    f"'{name}' is not supported: it names {what}, and the agentkv router "
                    "stores none. Send the whole history in 'input' (prompt_cache_key or "
                    "x-session-id keeps its KV for the next turn).",
                    param=name,
                    code="unsupported_parameter",
                )
        if body.get("background"):
            raise RouterError(
                400,
                "'background' is not supported: a background response must be stored on the "
                "server, and the agentkv router stores none.",
                param="background",
                code="unsupported_parameter",
            )
        limit = body.get("max_output_tokens")
        if limit is not None and (_int_or_none(limit) is None or limit < 1):
            raise invalid_parameter("max_output_tokens", "must be a positive integer")

    def prefill_body(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        return {**body, "stream": False, "max_output_tokens": 1, wire.KV_TRANSFER_PARAMS: params}

    def output_limit(self, body: dict[str, Any]) -> int | None:
        return _positive_or_none(body.get("max_output_tokens"))

    def prompt_usage(self, answer: dict[str, Any]) -> PromptUsage:
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        details = usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return PromptUsage(_int_or_none(usage.get("input_tokens")), _int_or_none(cached))

    def stream_editor(self) -> StreamEditor:
        return _ResponsesStreamEditor()


_FORMATS: dict[Endpoint, WireFormat] = {
    "chat": _Completions("chat", "/v1/chat/completions", "messages", "a non-empty list"),
    "completion": _Completions(
        "completion", "/v1/completions", "prompt", "a non-empty string or list"
    ),
    "responses": _Responses(),
}


def wire_format(endpoint: Endpoint) -> WireFormat:
    return _FORMATS[endpoint]


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive_or_none(value: object) -> int | None:
    number = _int_or_none(value)
    return number if number is not None and number > 0 else None
