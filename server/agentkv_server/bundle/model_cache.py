"""Where prepared models live, and how one is put there without a half-written directory.

Models (the random test models and the converted packaged model) are prepared on first use into
``$AGENTKV_CACHE_DIR`` (default ``~/.cache/agentkv/models``) and reused afterwards. Each is
written into a temporary directory beside its target and renamed into place in one step, so
concurrent first uses are safe and an interrupted one leaves nothing that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from agentkv_server import wire

__all__ = ["MANIFEST", "Dtype", "build_atomically", "built_dtype", "cache_dir", "manifest"]

Dtype = Literal["float32", "bfloat16", "float16"]

MANIFEST = "agentkv_model.json"  # how a directory was prepared: source, dtype, builder version


def cache_dir() -> Path:
    """Where prepared models live: ``$AGENTKV_CACHE_DIR`` or ``~/.cache/agentkv/models``."""
    configured = os.environ.get(wire.CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "agentkv" / "models"


def build_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, first running ``build(staging_dir)`` and renaming the result into
    place unless a finished ``target`` (one with a manifest) is already there."""
    if (target / MANIFEST).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / MANIFEST).is_file():  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def manifest(model_dir: Path) -> dict[str, Any] | None:
    """The manifest agentkv wrote when it prepared ``model_dir`` (None for any other model)."""
    try:
        found = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def built_dtype(model_dir: Path) -> Dtype | None:
    """The dtype agentkv prepared a model in (None for any other model directory).

    Engines must be told: vLLM's ``--dtype auto`` serves float32 weights as bfloat16, which
    would quietly turn the fp32 oracle model into a bf16 one."""
    return (manifest(model_dir) or {}).get("dtype")
