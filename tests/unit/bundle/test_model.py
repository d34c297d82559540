"""The local test model: built without a hub, atomically, once; loadable by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv_server.bundle import model as model_module
from agentkv_server.bundle.model import (
    CHAT_TEMPLATE,
    PRESETS,
    ensure_model,
    resolve_model,
    tool_call_logit_bias,
    training_text,
)
from agentkv_server.errors import ConfigError


def test_tiny_model_has_the_preset_shape(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    preset = PRESETS["tiny"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert config["vocab_size"] == preset.vocab_size
    assert (tiny / "model.safetensors").stat().st_size < 25 * 2**20  # ~4.5M fp32 parameters


def test_weights_are_seeded(tmp_path: Path, tiny: Path) -> None:
    again = ensure_model("tiny", root=tmp_path)
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


def test_built_model_is_reused_and_no_staging_dir_is_left(tiny: Path, monkeypatch) -> None:
    monkeypatch.setattr(model_module, "build_model", pytest.fail)  # must not build again
    assert ensure_model("tiny", root=tiny.parent) == tiny
    assert [p.name for p in tiny.parent.iterdir()] == [tiny.name]


def test_chat_template_renders_tools_and_tool_calls(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "add one"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\n2\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_each_turns_rendering_is_a_prefix_of_the_next(tiny: Path) -> None:
    """What makes KV reuse across turns possible at all."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    first = tokenizer.apply_chat_template(turn1, tokenize=False, add_generation_prompt=True)
    second = tokenizer.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True)
    assert second.startswith(first)


def test_special_tokens_are_single_tokens(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(token)) == 1
    assert tokenizer.eos_token == "<|im_end|>"


def test_training_text_is_deterministic() -> None:
    assert training_text(0, lines=50) == training_text(0, lines=50)
    assert training_text(0, lines=50) != training_text(1, lines=50)


def test_unknown_preset_and_missing_directory_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown model preset"):
        ensure_model("huge", root=tmp_path)
    with pytest.raises(ConfigError, match="neither a model name"):
        resolve_model(str(tmp_path / "absent"))


def test_resolve_model_accepts_a_directory(tiny: Path) -> None:
    assert resolve_model(str(tiny)) == (tiny, tiny.name)


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path))
    assert model_module.cache_dir() == tmp_path
    monkeypatch.delenv("AGENTKV_CACHE_DIR")
    assert model_module.cache_dir() == Path.home() / ".cache" / "agentkv" / "models"


def test_tool_call_logit_bias_favours_tokens_that_close_json(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    bias = tool_call_logit_bias(tiny)
    assert {tokenizer.decode([int(token_id)]) for token_id in bias} == {
        '"',
        ' "',
        ":",
        ",",
        "}",
        "<|im_end|>",
    }
    assert set(bias.values()) == {12}
