"""The local test model: a Llama with seeded random weights and a locally trained tokenizer.

Tests and ``agentkv serve`` need a model that vLLM loads like any other, without a model hub.
A model is built on first use into a cache directory (``AGENTKV_CACHE_DIR``, default
``~/.cache/agentkv/models``) and reused afterwards; nothing large is committed. Building is
atomic (a temporary directory renamed into place), so concurrent first uses are safe.

The weights use the usual 0.02-std init. Measured on the tiny preset at 2k tokens of context
(docs/engines.md): a wrong KV prefix moves the top-5 first-token logprobs by ~0.9 nats, bf16
rounding by ~0.006 and fp32 rounding by <1e-4, so an fp32 model lets the test oracle tell wrong KV
from noise. A larger init spreads the logits but makes bf16 noise as large as a wrong prefix.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from agentkv_server.errors import ConfigError

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_PRESET",
    "PRESETS",
    "TOOL_CALL_PARSER",
    "Dtype",
    "ModelPreset",
    "build_model",
    "built_dtype",
    "cache_dir",
    "ensure_model",
    "resolve_model",
    "tool_call_logit_bias",
]

Dtype = Literal["float32", "bfloat16", "float16"]

# Bumped whenever a change here would produce a different model for the same preset.
BUILDER_VERSION = 1

# vLLM's parser for the `<tool_call>{json}</tool_call>` format the chat template uses.
TOOL_CALL_PARSER = "hermes"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MANIFEST = "agentkv_model.json"  # how a directory was built: preset, dtype, seed, builder

# ChatML with Hermes-style tools: every turn's rendering is a prefix of the next turn's, which
# is what makes KV reuse across turns possible at all.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call one or more functions. Function signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call a function, answer with <tool_call>{"name": <function-name>, \
"arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}<tool_call>
{"name": "{{ fn.name }}", "arguments": \
{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


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


PRESETS: dict[str, ModelPreset] = {
    # ~4.5M parameters: starts fast, default for tests and `agentkv serve`.
    "tiny": ModelPreset("tiny", 256, 4, 4, 4, 768, 4096, tie_embeddings=True),
    # ~100M parameters: prefill cost is visible on a CPU, for measurements.
    "small": ModelPreset("small", 1024, 8, 16, 4, 2560, 8192, tie_embeddings=False),
}

DEFAULT_PRESET = "tiny"


def cache_dir() -> Path:
    """Where built models live: ``$AGENTKV_CACHE_DIR`` or ``~/.cache/agentkv/models``."""
    configured = os.environ.get("AGENTKV_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "agentkv" / "models"


def ensure_model(
    preset: str = DEFAULT_PRESET,
    *,
    dtype: Dtype = "float32",
    seed: int = 0,
    root: Path | None = None,
) -> Path:
    """Return the directory of a built model, building it first if it is not cached yet."""
    spec = _preset(preset)
    root = root or cache_dir()
    target = root / f"{spec.served_name}-{dtype}-s{seed}-v{BUILDER_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        build_model(spec, staging, dtype=dtype, seed=seed)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(model: str | None, *, dtype: Dtype = "float32") -> tuple[Path, str]:
    """Map ``--model`` (a preset name, a directory, or None for the default) to a model
    directory and the name vLLM should serve it under."""
    name = model or DEFAULT_PRESET
    if name in PRESETS:
        return ensure_model(name, dtype=dtype), PRESETS[name].served_name
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory"
        )
    return path.resolve(), path.name


def built_dtype(model_dir: Path) -> Dtype | None:
    """The dtype a test model was built in (None for any other model directory).

    Engines must be told: vLLM's ``--dtype auto`` serves float32 weights as bfloat16, which
    would quietly turn the fp32 oracle model into a bf16 one."""
    try:
        return json.loads((model_dir / MANIFEST).read_text())["dtype"]
    except (OSError, ValueError, KeyError):
        return None


def tool_call_logit_bias(model_dir: Path, strength: int = 12) -> dict[str, int]:
    """An OpenAI ``logit_bias`` that makes the random model close what it opens.

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
