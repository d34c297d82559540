from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from agentkv_server.bench.workload import (
    PRESETS,
    FileTokenizer,
    ToolLatency,
    WordTokenizer,
    Workload,
    load_tokenizer,
    text_of_tokens,
)
from agentkv_server.errors import ConfigError


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> FileTokenizer:
    """A small byte-level BPE, trained like the test model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    rng = random.Random(1)
    words = [
        "agent",
        "tool",
        "result",
        "search",
        "order",
        "weather",
        "the",
        "of",
        "and",
        "value",
        "json",
    ]
    tokenizer.train_from_iterator(
        [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)], trainer=trainer
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return FileTokenizer(path)


def workload(**changes: object) -> Workload:
    fields = {
        "sessions": 2,
        "turns": 4,
        "history_tokens": (100, 300),
        "new_tokens": 20,
        "output_tokens": 5,
    }
    return Workload(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [1, 17, 150, 2000])
def test_text_has_the_asked_token_count_in_the_models_tokenizer(
    bpe: FileTokenizer, tokens: int
) -> None:
    text = text_of_tokens(bpe, tokens, random.Random(tokens))
    assert abs(len(bpe.encode(text)) - tokens) <= 1


def test_word_tokenizer_counts_exactly() -> None:
    text = text_of_tokens(WordTokenizer(), 150, random.Random(0))
    assert len(text.split()) == 150
    assert text_of_tokens(WordTokenizer(), 0, random.Random(0)) == ""


def test_texts_depend_on_seed_session_and_turn_but_not_on_the_mode() -> None:
    w, tok = workload(), WordTokenizer()
    assert w.new_text(tok, 100, 0, 2) == workload().new_text(tok, 100, 0, 2)
    assert w.new_text(tok, 100, 0, 2) != w.new_text(tok, 100, 0, 3)
    assert w.new_text(tok, 100, 0, 2) != w.new_text(tok, 100, 1, 2)
    assert w.new_text(tok, 100, 0, 2) != workload(seed=1).new_text(tok, 100, 0, 2)


def test_history_starts_with_the_salt_and_has_the_asked_size() -> None:
    w, tok = workload(), WordTokenizer()
    a, b = w.history_text(tok, 300, 0, "run1-agentkv"), w.history_text(tok, 300, 0, "run1-upstream")
    assert a.splitlines()[0] != b.splitlines()[0]  # no prefix-cache hits across modes
    assert a.splitlines()[1:] == b.splitlines()[1:]  # same content otherwise
    assert len(a.split("\n", 1)[1].split()) == 300


def test_tool_latencies_one_per_follow_up_turn_and_reproducible() -> None:
    w = workload(tool_latency=ToolLatency("exponential", 2.0))
    sleeps = w.tool_latencies(100, 1)
    assert len(sleeps) == w.turns - 1
    assert sleeps == w.tool_latencies(100, 1) != w.tool_latencies(100, 0)
    assert workload(tool_latency=ToolLatency("fixed", 0.5)).tool_latencies(100, 0) == [0.5] * 3


@pytest.mark.parametrize("kind", ["exponential", "lognormal", "uniform"])
def test_tool_latency_distributions_centre_on_their_mean(kind: str) -> None:
    latency = ToolLatency(kind, 2.0)  # type: ignore[arg-type]
    rng = random.Random(7)
    samples = [latency.sample(rng) for _ in range(4000)]
    assert min(samples) >= 0
    centre = statistics.median(samples) if kind == "lognormal" else statistics.fmean(samples)
    assert centre == pytest.approx(2.0, rel=0.1)


def test_tool_latency_parses_the_command_line_form() -> None:
    assert ToolLatency.parse("lognormal:1.5") == ToolLatency("lognormal", 1.5)
    assert ToolLatency.parse("0.25") == ToolLatency("fixed", 0.25)
    assert str(ToolLatency.parse("exponential:2")) == "exponential:2"
    with pytest.raises(ConfigError):
        ToolLatency.parse("lognormal:soon")
    with pytest.raises(ConfigError):
        ToolLatency.parse("soon:1")
    with pytest.raises(ConfigError):
        ToolLatency("fixed", -1.0)


@pytest.mark.parametrize(
    "changes", [{"sessions": 0}, {"turns": 0}, {"history_tokens": ()}, {"history_tokens": (-1,)}]
)
def test_invalid_workloads_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        workload(**changes)


def test_vllm_preset_has_the_published_shape() -> None:
    w = PRESETS["vllm"].workload
    assert (w.sessions, w.turns, w.new_tokens, w.output_tokens) == (10, 10, 150, 300)
    assert len(w.history_tokens) > 1


def test_quick_preset_is_small() -> None:
    preset = PRESETS["quick"]
    w = preset.workload
    assert preset.model == "tiny" and preset.repeats == 1
    assert w.sessions * w.turns * len(w.history_tokens) <= 12


def test_overrides_replace_only_what_is_given() -> None:
    preset = PRESETS["quick"].with_overrides(turns=7, repeats=3, sessions=None)
    assert preset.workload.turns == 7 and preset.repeats == 3
    assert preset.workload.sessions == PRESETS["quick"].workload.sessions
    assert preset.kv_cache_gib == PRESETS["quick"].kv_cache_gib == 1
    assert PRESETS["cpu"].with_overrides(kv_cache_gib=2).kv_cache_gib == 2


def test_load_tokenizer(tmp_path: Path, bpe: FileTokenizer) -> None:
    assert isinstance(load_tokenizer(None), WordTokenizer)
    with pytest.raises(ConfigError):
        load_tokenizer(tmp_path)
