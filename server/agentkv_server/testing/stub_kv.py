"""The stub engines' KV: what a decode engine retains, what a prefill engine pulls, and the
``kv_transfer_params`` each answers with, as NixlConnector with agentkv's connector would.

Tokens are counts, not contents: a pull moves a retained request's token count, and a prefix
hit is the longest live retained request (the stub does not compare token contents).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv_server import wire

__all__ = [
    "UPSTREAM_RETENTION_S",
    "Retained",
    "holding_params",
    "prefill_params",
    "prefix_hit",
    "retention_s",
    "take_retained",
]

UPSTREAM_RETENTION_S = 480.0
_BLOCK_TOKENS = 16


@dataclass
class Retained:
    """KV a decode engine keeps after a request finished."""

    num_tokens: int
    deadline: float

    def alive(self) -> bool:
        return time.monotonic() < self.deadline


def _transfer_params(engine_id: str, port: int, request_id: str, num_tokens: int) -> dict[str, Any]:
    """What names one engine's blocks of one request to a peer that pulls them."""
    return {
        wire.REMOTE_ENGINE_ID: engine_id,
        wire.REMOTE_REQUEST_ID: request_id,
        wire.REMOTE_BLOCK_IDS: list(range(-(-num_tokens // _BLOCK_TOKENS))),
        wire.REMOTE_HOST: "127.0.0.1",
        wire.REMOTE_PORT: port,
    }


def prefill_params(engine_id: str, port: int, prompt_tokens: int) -> dict[str, Any]:
    """P's returned params: the decode engine pulls the prompt's KV from P."""
    request_id = f"p-{uuid.uuid4().hex}"
    return {
        wire.DO_REMOTE_PREFILL: True,
        wire.DO_REMOTE_DECODE: False,
        **_transfer_params(engine_id, port, request_id, prompt_tokens),
        "tp_size": 1,
    }


def retention_s(params: Mapping[str, Any]) -> float:
    """How long D keeps a finished request: the router's hint, else upstream's default after a
    P step, else nothing (a decode-only request upstream does not retain)."""
    retention = params.get(wire.RETENTION_SECONDS)
    if retention is None:
        return UPSTREAM_RETENTION_S if params.get(wire.DO_REMOTE_PREFILL) else 0.0
    return float(retention)


def holding_params(
    engine_id: str,
    port: int,
    request_id: str,
    num_tokens: int,
    retention: float,
    *,
    hinted: bool,
    capacity: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """D's returned params for a retained request; ``hinted`` (the router asked for a
    retention) adds agentkv's expiry, and ``capacity`` the engine's KV size, as agentkv's
    connector does."""
    holding = {
        wire.DO_REMOTE_DECODE: True,
        wire.DO_REMOTE_PREFILL: False,
        **_transfer_params(engine_id, port, request_id, num_tokens),
        wire.REMOTE_NUM_TOKENS: num_tokens,
        wire.REMOTE_BLOCKS_EXPIRY_TIME: time.perf_counter() + retention,
    }
    if hinted:
        holding[wire.EXPIRES_IN_SECONDS] = retention
        holding.update(capacity or {})
    return holding


def take_retained(retained: dict[str, Retained], request_id: str) -> int:
    """Tokens of a live retained request, which a pull frees; 0 when it is gone or expired."""
    entry = retained.pop(request_id, None)
    return entry.num_tokens if entry is not None and entry.alive() else 0


def prefix_hit(retained: Mapping[str, Retained], prompt_tokens: int) -> int:
    """Tokens a decode engine's prefix cache covers: its longest live retained request's."""
    held = [entry.num_tokens for entry in retained.values() if entry.alive()]
    return min(max(held, default=0), prompt_tokens)
