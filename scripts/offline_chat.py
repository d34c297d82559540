"""A chat-completions client without an engine, for measuring tool calls when no engine may run.

Decodes greedily with transformers (fp32) under the grammar vLLM would impose: the hermes
structural tag vLLM builds for ``tool_choice`` and ``strict`` tools, or the JSON schema of a
``response_format``, compiled by xgrammar; it parses calls as vLLM's hermes parser does. Checked
against the engine: the same calls on the examples' old task (``add(4, 5)``). Slow (no batching,
no prefix cache across calls beyond the system turn), one request at a time.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import xgrammar
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
)
from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class OfflineChat:
    """``chat.completions.create`` over a local model directory (greedy; the options used here)."""

    def __init__(self, model_dir: Path) -> None:
        torch.set_num_threads(1)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.vocab_size = self.model.config.vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.system_kv: dict[tuple[int, ...], Any] = {}
        self.chat = SimpleNamespace(completions=self)

    def create(self, *, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               tool_choice: Any, max_tokens: int, response_format: Any = None,
               **_: Any) -> Any:  # fmt: skip
        prompt = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        text, finish = self._decode(
            ids, self._grammar(tools, tool_choice, response_format), max_tokens
        )
        calls = [] if tool_choice == "none" else _calls(text)
        message = SimpleNamespace(content=None if calls else text, tool_calls=calls or None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason=finish)])

    def _grammar(self, tools: list[dict[str, Any]], choice: Any, response_format: Any) -> Any:
        if choice == "none":
            if response_format is None:
                return None
            schema = response_format["json_schema"]["schema"]
            return self.compiler.compile_json_schema(json.dumps(schema))
        params = [ChatCompletionToolsParam(**tool) for tool in tools]
        if isinstance(choice, dict):
            choice = ChatCompletionNamedToolChoiceParam(**choice)
        tag = get_model_structural_tag("hermes", params, choice, reasoning=False)
        return None if tag is None else self.compiler.compile_structural_tag(tag.model_dump_json())

    def _decode(self, ids: list[int], grammar: Any, max_tokens: int) -> tuple[str, str]:
        matcher = xgrammar.GrammarMatcher(grammar) if grammar is not None else None
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        past, pending = self._after_system_turn(ids)
        out: list[int] = []
        for _ in range(max_tokens):
            with torch.no_grad():
                step = self.model(torch.tensor([pending]), past_key_values=past, use_cache=True)
            past, logits = step.past_key_values, step.logits[0, -1:].clone()
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask)
                xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            token = int(torch.argmax(logits[0]))
            if token == self.end:
                return self.tokenizer.decode(out), "stop"
            out.append(token)
            if matcher is not None and matcher.accept_token(token) and matcher.is_terminated():
                return self.tokenizer.decode(out), "stop"
            pending = [token]
        return self.tokenizer.decode(out), "length"

    def _after_system_turn(self, ids: list[int]) -> tuple[Any, list[int]]:
        """The system turn's KV (computed once per distinct system turn) and the rest to feed."""
        marker = self.tokenizer("<|im_start|>user", add_special_tokens=False)["input_ids"]
        cut = next((i for i in range(len(ids)) if ids[i : i + len(marker)] == marker), len(ids) - 1)
        key = tuple(ids[:cut])
        if key not in self.system_kv:
            with torch.no_grad():
                self.system_kv[key] = self.model(torch.tensor([ids[:cut]])).past_key_values
        return copy.deepcopy(self.system_kv[key]), ids[cut:]


def _calls(text: str) -> list[Any]:
    calls = []
    for index, match in enumerate(CALL.finditer(text)):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        function = SimpleNamespace(
            name=call.get("name"), arguments=json.dumps(call.get("arguments"))
        )
        calls.append(SimpleNamespace(id=f"call_{index}", function=function))
    return calls
