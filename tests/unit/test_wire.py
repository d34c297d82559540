"""The wire module spells every router <-> engine name as docs/protocol.md does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from agentkv_server import wire

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _documented() -> set[str]:
    return set(re.findall(r"`([^`\s]+)`", DOCS.read_text())) | set(
        re.findall(r'"([a-z_]+)"', DOCS.read_text())
    )


def test_every_agentkv_field_and_name_is_documented() -> None:
    documented = _documented()
    names = {
        wire.KV_TRANSFER_PARAMS,
        wire.RETENTION_SECONDS,
        wire.TICKET,
        wire.RELEASE,
        wire.EXPIRES_IN_SECONDS,
        wire.EXPIRES_AT,
        wire.BLOCK_HASHES,
        wire.HASH_BLOCK_SIZE,
        wire.TAIL_TOKEN_IDS,
        wire.KV_LOAD,
        wire.KV_LOAD_FROM,
        wire.KV_LOAD_OK,
        wire.KV_LOAD_FAILED,
        wire.EXTRA_ROUTER_URL,
        wire.EXTRA_SECRET,
        wire.ROUTER_URL_ENV,
        wire.SECRET_ENV,
        wire.REPORT_TICKET,
        wire.REMOTE_NUM_TOKENS,
        *wire.cold_prefill_params(),
    }
    assert names - documented == set()
    assert f"<router>{wire.REPORT_PATH}" in documented
    assert f"{wire.SECRET_HEADER}: <shared secret>" in DOCS.read_text()


def test_cold_params_as_documented_and_fresh() -> None:
    cold = wire.cold_prefill_params()
    assert cold == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    cold["remote_host"] = "h"
    assert wire.cold_prefill_params()["remote_host"] is None


def test_builders() -> None:
    held = {"remote_request_id": "d-1", "remote_num_tokens": 40, "do_remote_decode": False}
    assert wire.pull_prefill_params(held) == {**held, "do_remote_decode": True}
    assert held["do_remote_decode"] is False
    assert wire.decode_params({"a": 1}, retention_s=30.0, ticket="t") == {
        "a": 1,
        "agentkv_retention_seconds": 30.0,
        "agentkv_ticket": "t",
    }
    assert wire.decode_params(None, retention_s=None, ticket=None) == {}
    releasing = wire.decode_params(None, retention_s=0.0, ticket=None, release=["d-1"])
    assert releasing == {"agentkv_retention_seconds": 0.0, "agentkv_release": ["d-1"]}
    assert not wire.is_housekeeping(releasing)  # a step that releases: its own KV counts
    assert wire.is_housekeeping(wire.release_body("m", ["d-1"])["kv_transfer_params"])
    assert wire.release_body("m", ["d-1"]) == {
        "model": "m",
        "prompt": ".",
        "max_tokens": 1,
        "kv_transfer_params": {"agentkv_release": ["d-1"]},
    }
    assert wire.holding_report("t", held) == {"ticket": "t", "kv_transfer_params": held}
    assert wire.transfer_params({"kv_transfer_params": "x"}) == {}
    assert wire.transfer_params(None) == {}


def test_a_renewal_and_the_holding_it_leaves() -> None:
    body = wire.renew_body("m", {"d-1": 60.0})
    assert body["kv_transfer_params"] == {"agentkv_renew": {"d-1": 60.0}}
    assert wire.is_housekeeping(body["kv_transfer_params"])  # its own KV is worth nothing
    held = {"remote_request_id": "d-1", "agentkv_expires_at": 1000.0,
            "remote_blocks_expiry_time": 5000.0}  # fmt: skip
    renewed = wire.renewed_params(held, 60.0, now=990.0)
    assert renewed["agentkv_expires_at"] == 1050.0
    assert renewed["remote_blocks_expiry_time"] == 5050.0  # the engine's clock, moved as far
    assert held["agentkv_expires_at"] == 1000.0  # a copy
    assert wire.renewed_params({"remote_request_id": "d-1"}, 60.0, now=990.0) == {
        "remote_request_id": "d-1"  # an upstream holding: nothing to move
    }


def test_importable_alone() -> None:
    """The connector imports it inside vLLM, scripts without the router's dependencies."""
    code = "import sys, agentkv_server.wire; print(sorted(m for m in sys.modules if m.split('.')[0] in {'vllm', 'fastapi', 'aiohttp', 'starlette'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_exports_sorted_and_resolve() -> None:
    assert wire.__all__ == sorted(wire.__all__)
    assert all(hasattr(wire, name) for name in wire.__all__)
