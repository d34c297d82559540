"""Which model ``--model`` means, and the random-weight test models.

``--model`` is a model directory, the real default model ``smollm2`` (SmolLM2-135M-Instruct,
converted from an installed package: packaged_model.py), or a random-weight *test model*
(``tiny``, ``tiny-long``, ``small``): a Llama with seeded random weights and a locally trained
tokenizer, which starts fast and exercises the KV path, but whose words are noise. Test models
are built on first use into the model cache (model_cache.py) and reused afterwards; nothing
large is committed.

``tiny-long`` is ``tiny`` with a 131,072-token context (same weights, same tokenizer: only
``max_position_embeddings`` grows), for long agent histories. One full-length sequence of it
needs 1 GiB of fp32 KV cache, so engines serving it get more than the usual 1 GiB
(``min_kv_cache_gib``; docs/engines.md, "Long histories").

The weights use the usual 0.02-std init. Measured on the tiny preset at 2k tokens of context
(docs/engines.md): a wrong KV prefix moves the top-5 first-token logprobs by ~0.9 nats, bf16
rounding by ~0.006 and fp32 rounding by <1e-4, so an fp32 model lets the test oracle tell wrong KV
from noise. A larger init spreads the logits but makes bf16 noise as large as a wrong prefix.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from agentkv_server.bundle.chat_template import CHAT_TEMPLATE
from agentkv_server.bundle.model_cache import (
    MANIFEST,
    Dtype,
    build_atomically,
    built_dtype,
    cache_dir,
    manifest,
)
from agentkv_server.bundle.packaged_model import PACKAGED_MODELS, ensure_packaged_model
from agentkv_server.errors import ConfigError

__all__ = [
    "DEFAULT_MODEL",
    "GIB",
    "MODEL_NAMES",
    "PRESETS",
    "Dtype",
    "ModelPreset",
    "build_model",
    "built_dtype",
    "cache_dir",
    "ensure_model",
    "is_test_model",
    "min_kv_cache_gib",
    "preset_of",
    "resolve_model",
    "tool_call_logit_bias",
]

# Bumped whenever a change here would produce a different model for the same preset.
BUILDER_VERSION = 1

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

GIB = 1 << 30
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a random-weight Llama. ``init_std`` is the weight init (see module doc)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    max_position_embeddings: int = 16384
    init_std: float = 0.02

    @property
    def served_name(self) -> str:
        return f"agentkv-{self.name}"

    def kv_bytes_per_token(self, dtype: Dtype = "float32") -> int:
        """KV cache one token takes on an engine (keys and values of every layer), with the
        KV cache in the model's dtype (vLLM's default)."""
        head_dim = self.hidden_size // self.num_heads
        return 2 * self.num_layers * self.num_kv_heads * head_dim * DTYPE_BYTES[dtype]

    def min_kv_cache_gib(self, dtype: Dtype = "float32") -> int:
        """The least whole GiB of KV cache per engine that holds one sequence of the full
        context. vLLM refuses to start an engine whose KV cache cannot hold one, and it holds
        one block back, so exactly the sequence's size is not enough: strictly more."""
        return self.kv_bytes_per_token(dtype) * self.max_position_embeddings // GIB + 1


# Random-weight test models: fast to start, words are noise.
PRESETS: dict[str, ModelPreset] = {
    # ~4.5M parameters: starts fast, for the tests.
    "tiny": ModelPreset("tiny", 256, 4, 4, 4, 768, 4096, tie_embeddings=True),
    # tiny with a 131,072-token context, for long agent histories: the same weights (the
    # context is no weight), 8 KiB of fp32 KV per token, so 1 GiB per full-length sequence.
    "tiny-long": ModelPreset(
        "tiny-long", 256, 4, 4, 4, 768, 4096, tie_embeddings=True, max_position_embeddings=131072
    ),
    # ~100M parameters: prefill cost is visible on a CPU, for measurements.
    "small": ModelPreset("small", 1024, 8, 16, 4, 2560, 8192, tie_embeddings=False),
}

# The real model `agentkv serve` and `agentkv bench` use unless told otherwise.
DEFAULT_MODEL = "smollm2"
MODEL_NAMES = (*PACKAGED_MODELS, *PRESETS)


def ensure_model(
    preset: str = "tiny",
    *,
    dtype: Dtype = "float32",
    seed: int = 0,
    root: Path | None = None,
) -> Path:
    """Return the directory of a built test model, building it first if it is not cached yet."""
    spec = _preset(preset)
    target = (root or cache_dir()) / f"{spec.served_name}-{dtype}-s{seed}-v{BUILDER_VERSION}"
    return build_atomically(
        target, lambda staging: build_model(spec, staging, dtype=dtype, seed=seed)
    )


def resolve_model(
    model: str | None, *, dtype: Dtype = "float32", root: Path | None = None
) -> tuple[Path, str]:
    """Map ``--model`` (a model name, a directory, or None for the default) to a model
    directory, prepared first if needed, and the name vLLM should serve it under."""
    name = model or DEFAULT_MODEL
    if name in PACKAGED_MODELS:
        packaged = PACKAGED_MODELS[name]
        return ensure_packaged_model(packaged, dtype=dtype, root=root), packaged.served_name
    if name in PRESETS:
        return ensure_model(name, dtype=dtype, root=root), PRESETS[name].served_name
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"--model {name!r} is neither a model name ({', '.join(MODEL_NAMES)}) nor a directory"
        )
    return path.resolve(), path.name


def is_test_model(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a random-weight test model (whose words are noise)."""
    return "preset" in (manifest(model_dir) or {})


def preset_of(
    model: str | Path | None, dtype: Dtype = "float32"
) -> tuple[ModelPreset, Dtype] | None:
    """The preset and dtype of ``--model`` (a name, a directory, or None for the default) when
    it is a random-weight test model: a preset name with ``dtype``, or a directory one was
    built into, with the dtype it was built in. None for any other model. Builds nothing."""
    name = str(model or DEFAULT_MODEL)
    if name in PRESETS:
        return PRESETS[name], dtype
    if name in PACKAGED_MODELS:
        return None
    built = manifest(Path(name).expanduser()) or {}
    try:
        return ModelPreset(**built["preset"]), built.get("dtype", dtype)
    except (KeyError, TypeError):  # not a test model, or one of another builder's shape
        return None


def min_kv_cache_gib(model: str | Path | None, dtype: Dtype = "float32") -> int:
    """The least KV cache (whole GiB per engine, ``VLLM_CPU_KVCACHE_SPACE``) that ``--model``
    needs: room for one full-length sequence of a test model (``ModelPreset.min_kv_cache_gib``),
    else 1 (the real models' contexts fit in 1 GiB; other directories are the user's to size)."""
    found = preset_of(model, dtype)
    return found[0].min_kv_cache_gib(found[1]) if found is not None else 1


def tool_call_logit_bias(model_dir: Path, strength: int = 12) -> dict[str, int]:
    """An OpenAI ``logit_bias`` that makes a random-weight test model close what it opens.

    Random weights almost never pick the token that ends a JSON string, nor the ``:`` after a
    key, and a JSON grammar lets them pad with whitespace forever, so a forced tool call runs to
    ``max_tokens``. Favouring quotes, ``:``, ``,``, ``}`` and the end-of-turn token lets a forced
    call of a ``strict`` tool return schema-valid arguments in a few tokens.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # "\u0120" is byte-level BPE's space: ' "' is a token of its own.
    closers = ('"', '\u0120"', ":", ",", "}", EOS_TOKEN)
    ids = (tokenizer.token_to_id(token) for token in closers)
    return {str(token_id): strength for token_id in ids if token_id is not None}


def build_model(spec: ModelPreset, out: Path, *, dtype: Dtype = "float32", seed: int = 0) -> None:
    """Write a loadable Hugging Face model directory (weights, tokenizer, chat template)."""
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, spec.vocab_size, seed)
    _write_weights(out, spec, dtype, seed)
    (out / MANIFEST).write_text(
        json.dumps(
            {"preset": asdict(spec), "dtype": dtype, "seed": seed, "builder": BUILDER_VERSION}
        )
    )


def _preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}"
        ) from None


def _write_weights(out: Path, spec: ModelPreset, dtype: Dtype, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    special_ids = _special_token_ids(out)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=special_ids[PAD_TOKEN],
        eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = special_ids[EOS_TOKEN]
    model.save_pretrained(out, safe_serialization=True)


def _write_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(seed), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _special_token_ids(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


_VOCABULARY = (
    "the of and to in is for on that with as it by this be are from or at an was we can "
    "agent tool call result session turn cache prefix decode prefill engine router model token "
    "search file read write list query weather city price order user assistant system error "
    "value name id data time date status open close true false null json request response "
    "function argument return class def import print self if else for while try except"
)


def training_text(seed: int, lines: int = 20000) -> list[str]:
    """Deterministic text resembling agent traffic (prose, JSON tool calls, code, numbers),
    enough for a byte-level BPE to learn useful merges."""
    rng = random.Random(seed)
    vocabulary = _VOCABULARY.split()

    def word() -> str:
        return rng.choice(vocabulary)

    text = []
    for i in range(lines):
        prose = " ".join(word() for _ in range(rng.randint(4, 24)))
        kind = i % 4
        if kind == 0:
            text.append(prose.capitalize() + ".")
        elif kind == 1:
            args = {word(): rng.choice([rng.randint(0, 9999), word()])}
            text.append(json.dumps({"name": f"{word()}_{word()}", "arguments": args}))
        elif kind == 2:
            text.append(f"def {word()}_{i}(x):\n    return x * {rng.randint(0, 99)}  # {prose}")
        else:
            text.append(
                f"{rng.randint(1, 31)}/{rng.randint(1, 12)}/{rng.randint(1990, 2030)} {prose}!"
            )
    return text
