from __future__ import annotations

from pathlib import Path

import pytest

from agentkv_server.bundle.model import ensure_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model, built once into a temporary cache."""
    return ensure_model("tiny", root=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The long-context tiny test model, built once into a temporary cache."""
    return ensure_model("tiny-long", root=tmp_path_factory.mktemp("long-models"))
