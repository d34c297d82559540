"""The local test model: built without a hub, atomically, once; loadable by transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agentkv_server.bundle import model as model_module
from agentkv_server.bundle.model import (
    CHAT_TEMPLATE,
    GIB,
    MANIFEST,
    PRESETS,
    ensure_model,
    min_kv_cache_gib,
    preset_of,
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


def test_tiny_long_is_tiny_with_a_131072_token_context() -> None:
    tiny, long = PRESETS["tiny"], PRESETS["tiny-long"]
    assert long == dataclasses.replace(tiny, name="tiny-long", max_position_embeddings=131072)
    assert long.served_name == "agentkv-tiny-long"


def test_tiny_long_has_tinys_weights_and_tokenizer_and_only_a_longer_context(
    tiny: Path, tiny_long: Path
) -> None:
    """The context is no weight: engines of either model compute the same logits (for prompts
    that fit both), and only vLLM's max_model_len (from max_position_embeddings) differs."""
    config, tiny_config = (json.loads((d / "config.json").read_text()) for d in (tiny_long, tiny))
    assert config.pop("max_position_embeddings") == 131072
    assert tiny_config.pop("max_position_embeddings") == 16384
    assert config == tiny_config
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_long / name).read_bytes() == (tiny / name).read_bytes()
    assert tiny_long.name.startswith("agentkv-tiny-long-float32")


def test_kv_bytes_per_token_follow_the_shape_and_dtype() -> None:
    # layers x KV heads x head dims x (keys, values) x bytes
    assert PRESETS["tiny"].kv_bytes_per_token("float32") == 4 * 4 * 64 * 2 * 4 == 8 * 1024
    assert PRESETS["tiny-long"].kv_bytes_per_token("bfloat16") == 4 * 1024
    assert PRESETS["small"].kv_bytes_per_token("float32") == 8 * 4 * 64 * 2 * 4


@pytest.mark.parametrize(
    ("preset", "dtype", "gib"),
    [
        ("tiny", "float32", 1),
        ("small", "float32", 1),
        ("small", "bfloat16", 1),
        # 131,072 tokens x 8 KiB = exactly 1 GiB, which vLLM refuses (it holds a block back).
        ("tiny-long", "float32", 2),
        ("tiny-long", "bfloat16", 1),  # 0.5 GiB
    ],
)
def test_each_preset_asks_for_the_least_kv_cache_that_holds_a_full_length_sequence(
    preset: str, dtype, gib: int
) -> None:
    spec = PRESETS[preset]
    sequence = spec.kv_bytes_per_token(dtype) * spec.max_position_embeddings
    assert spec.min_kv_cache_gib(dtype) == gib == min_kv_cache_gib(preset, dtype)
    assert (gib - 1) * GIB <= sequence < gib * GIB


def test_min_kv_cache_gib_of_other_models_and_of_a_built_test_models_directory(
    tmp_path: Path,
) -> None:
    assert min_kv_cache_gib(None) == min_kv_cache_gib("smollm2") == 1
    assert min_kv_cache_gib(str(tmp_path)) == 1  # a directory without agentkv's manifest
    built = {"preset": dataclasses.asdict(PRESETS["tiny-long"]), "dtype": "float32"}
    (tmp_path / MANIFEST).write_text(json.dumps(built))
    assert preset_of(tmp_path, "bfloat16") == (PRESETS["tiny-long"], "float32")
    assert min_kv_cache_gib(tmp_path, dtype="bfloat16") == 2  # the dtype it was built in
    (tmp_path / MANIFEST).write_text(json.dumps({"preset": {"unknown": 1}}))
    assert preset_of(tmp_path) is None and min_kv_cache_gib(tmp_path) == 1
