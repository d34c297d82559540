"""Continuing a streamed answer on another decode engine when its engine breaks mid-stream.

Before its first chunk a failed decode step is simply retried elsewhere (orchestrator/); once
chunks went to the client the router instead continues the same stream (orchestrator/relay.py):
another decode engine recomputes the prompt plus what was already sent and generates only the
rest (docs/faults.md, "A stream that breaks"). That needs exactly what the client received:

- completions: the generated token ids. The engine is asked for them (vLLM's
  ``return_token_ids``); for a client that did not ask, the id lists are written back as the
  ``null`` vLLM writes without it, so its bytes do not change. The continuation's prompt is the
  prompt's ids (the first chunk's ``prompt_token_ids``) plus the generated ids, so a greedy
  continuation is the uninterrupted answer.
- chat: the assistant text so far, continued with ``continue_final_message`` (the chat
  template re-tokenizes that text; asking chat for ids would change its chunks, since vLLM then
  sends a chunk for every token a parser holds back). A stream whose tool-call or reasoning
  deltas had begun is not continued: a re-rendered partial tool call or thought is not the
  model's own, and a broken tool call is worse than an ended stream.

Only whole SSE events go to the client, so a break never leaves half an event. While nothing
fails, the editor appends each passed-on part to a list and (completions) rewrites the id lists
with one regex; parts are parsed only after a break, and on the continued stream, whose chunks
are rewritten to read as one answer (the first stream's ``id`` and ``created``, usage counted
over the whole answer).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from agentkv_server.router.formats import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    OUTPUT_LIMIT_FIELDS,
    Endpoint,
)

__all__ = ["Progress", "ResumableStream", "continuation_body", "resumable", "tracked_body"]

_DONE = b"data: [DONE]"
_SEPARATOR = b"\n\n"
# vLLM writes compact JSON; literal replacements keep this at about 1 us per chunk.
_TOKEN_IDS = re.compile(rb'"token_ids":\[[^\]]*\]')
_PROMPT_TOKEN_IDS = re.compile(rb'"prompt_token_ids":\[[^\]]*\]')


def resumable(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Whether a broken stream of this request can be continued elsewhere: one choice of a
    chat or completion stream, without echo, of one prompt (text or token ids)."""
    if endpoint == "responses" or body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        return False
    if endpoint == "chat":
        return True
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or all(type(t) is int for t in prompt or ())
    return single and not body.get("echo")


def tracked_body(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """The body to send a decode engine so that its stream tells the generated token ids."""
    if endpoint != "completion" or body.get("return_token_ids"):
        return body
    return {**body, "return_token_ids": True}


@dataclass
class Progress:
    """What the client has received of the answer so far."""

    endpoint: Endpoint
    stream_id: str | None = None
    created: int | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    chunks: int = 0
    """Chunks that carried generated text: chat's count of sent tokens (one per chunk while no
    parser holds tokens back, vLLM's default stream interval)."""
    blocker: str | None = None
    """Why the answer cannot be continued (a tool call or reasoning had begun)."""
    finished: bool = False

    def blocker_for(self, body: dict[str, Any]) -> str | None:
        """Why the answer to ``body`` cannot be continued; None when it can (or is complete)."""
        if self.finished or self.endpoint != "completion":
            return None if self.finished else self.blocker
        if self.text and not self.token_ids:
            return "the engine sent no token ids"
        if self.prompt_token_ids is None and not isinstance(body.get("prompt"), list):
            return "the engine sent no prompt token ids"
        return None

    @property
    def sent_tokens(self) -> int:
        return len(self.token_ids) if self.endpoint == "completion" else self.chunks

    def add(self, chunk: dict[str, Any]) -> None:
        if self.stream_id is None:
            self.stream_id, self.created = chunk.get("id"), chunk.get("created")
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.endpoint == "completion":
                self._add_completion(choice)
            else:
                self._add_chat(choice.get("delta") or {})

    def _add_completion(self, choice: dict[str, Any]) -> None:
        if self.prompt_token_ids is None and choice.get("prompt_token_ids"):
            self.prompt_token_ids = list(choice["prompt_token_ids"])
        self.token_ids.extend(choice.get("token_ids") or ())
        if text := choice.get("text"):
            self.text.append(text)

    def _add_chat(self, delta: dict[str, Any]) -> None:
        if delta.get("tool_calls"):
            self.blocker = "a tool call had begun"
        elif delta.get("reasoning") or delta.get("reasoning_content"):
            self.blocker = "reasoning had begun"
        if content := delta.get("content"):
            self.text.append(content)
            self.chunks += 1


def continuation_body(body: dict[str, Any], progress: Progress) -> dict[str, Any] | None:
    """The request that generates the rest of the answer; None when there is no rest (call
    only when :meth:`Progress.blocker_for` found nothing in the way)."""
    if progress.finished:
        return None
    sent = progress.sent_tokens
    continued = dict(body)
    if progress.endpoint == "completion":
        prompt = body["prompt"] if isinstance(body["prompt"], list) else progress.prompt_token_ids
        assert prompt is not None
        continued.update(prompt=[*prompt, *progress.token_ids], return_token_ids=True)
        continued.setdefault("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    else:
        continued.update(
            messages=_with_partial_answer(body, "".join(progress.text)),
            continue_final_message=True,
            add_generation_prompt=False,
        )
    for name in OUTPUT_LIMIT_FIELDS:
        if isinstance(limit := continued.get(name), int):
            if limit - sent < 1:
                return None
            continued[name] = limit - sent
    if isinstance(least := continued.get("min_tokens"), int):
        continued["min_tokens"] = max(least - sent, 0)
    return continued


def _with_partial_answer(body: dict[str, Any], text: str) -> list[dict[str, Any]]:
    messages = list(body["messages"])
    last = messages[-1] if messages else {}
    continuing = body.get("continue_final_message") and last.get("role") == "assistant"
    if continuing and isinstance(last.get("content"), str):  # the client's own continuation
        messages[-1] = {**last, "content": last["content"] + text}
        return messages
    messages.append({"role": "assistant", "content": text})
    return messages


class ResumableStream:
    """The :class:`~agentkv_server.router.formats.StreamEditor` of a stream that may be
    continued: passes on whole events, remembers them, ends at ``data: [DONE]``."""

    def __init__(self, endpoint: Endpoint, *, client_wants_ids: bool) -> None:
        self.kv_transfer_params: dict[str, Any] | None = None
        self.ended = False
        self._strip_ids = endpoint == "completion" and not client_wants_ids
        self._progress = Progress(endpoint)
        self._sent: list[bytes] = []  # passed on as the engine wrote them, not yet parsed
        self._pending = b""
        self._continuing = False
        self._offset = 0  # tokens sent before the stream now relayed began

    def feed(self, chunk: bytes) -> tuple[bytes, bytes | None]:
        events, separator, self._pending = (self._pending + chunk).rpartition(_SEPARATOR)
        if not separator:
            return b"", None
        head, done, tail = (events + separator).partition(_DONE)
        if self._continuing:
            head = self._rewrite(head)
        elif head:
            self._sent.append(head)
            if self._strip_ids:
                head = _without_ids(head)
        if not done:
            return head, None
        self.ended = True
        return head, done + tail

    def flush(self) -> bytes:
        self._pending = b""  # half an event: never sent
        return b""

    def progress(self) -> Progress:
        """What the client has received (parses what was passed on since the last call)."""
        for part in self._sent:
            for event in _data_events(part):
                self._progress.add(event)
        self._sent = []
        return self._progress

    def continue_stream(self) -> None:
        """The next chunks come from a continuation: rewrite them to read as this answer."""
        self._offset = self.progress().sent_tokens
        self._continuing = True
        self._pending = b""

    def finish(self) -> bytes:
        """The end of an answer whose last token was sent before its engine broke."""
        self.ended = True
        return _DONE + _SEPARATOR

    def _rewrite(self, head: bytes) -> bytes:
        out: list[bytes] = []
        for event in _data_events(head):
            chunk = self._as_continued(event)
            if chunk is not None:
                self._progress.add(event)
                data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
                out.append(b"data: " + data.encode() + _SEPARATOR)
        return b"".join(out)

    def _as_continued(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """``event`` as part of the first stream; None for the continuation's role chunk."""
        chunk = {**event, "id": self._progress.stream_id, "created": self._progress.created}
        if "prompt_token_ids" in chunk:  # chat's, of the continuation's prompt
            chunk["prompt_token_ids"] = None
        choices = []
        for choice in event.get("choices") or ():
            choice = dict(choice)
            if "delta" in choice:
                delta = {k: v for k, v in (choice["delta"] or {}).items() if k != "role"}
                role_only = "role" in choice["delta"] and not any(delta.values())
                if role_only and choice.get("finish_reason") is None:
                    return None
                choice["delta"] = delta
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
            if self._strip_ids and "token_ids" in choice:
                choice["token_ids"] = None
            choices.append(choice)
        chunk["choices"] = choices
        if isinstance(usage := event.get("usage"), dict):
            chunk["usage"] = self._whole_answer_usage(usage)
        return chunk

    def _whole_answer_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's prompt held the tokens sent before it: count them as output."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return usage
        return {
            **usage,
            "prompt_tokens": max(prompt - self._offset, 0),
            "completion_tokens": completion + self._offset,
        }


def _without_ids(head: bytes) -> bytes:
    """``head`` as vLLM writes it without ``return_token_ids``."""
    head = _TOKEN_IDS.sub(b'"token_ids":null', head)
    if b'"prompt_token_ids":[' in head:  # the first chunk only
        head = _PROMPT_TOKEN_IDS.sub(b'"prompt_token_ids":null', head)
    return head


def _data_events(part: bytes) -> list[dict[str, Any]]:
    events = []
    for event in part.split(_SEPARATOR):
        if event.startswith(b"data:") and not event.startswith(_DONE):
            try:
                data = json.loads(event[5:])
            except ValueError:
                continue
            if isinstance(data, dict):
                events.append(data)
    return events
