"""What the benchmark measures: one record per model call, as plain JSON-ready values."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["BenchResult", "TurnRecord"]


@dataclass(frozen=True)
class TurnRecord:
    """One turn of one session in one mode and repeat.

    Times are client-side: ``ttft_s`` runs from sending the request to the first streamed chunk,
    ``latency_s`` to the stream's end. ``reused_tokens`` is what the prefill engine pulled from a
    decode holder (router header ``x-agentkv-reused-tokens``) or, without a router, what the
    engine's prefix cache served (``usage.prompt_tokens_details.cached_tokens``); ``None`` when
    neither was reported. ``decode_kv_usage`` is the decode engines' KV cache in use right after
    the turn (``vllm:kv_cache_usage_perc``, 0..1), ``decode_kv_tokens`` the same in tokens.

    The breakdown of a routed turn: ``plan_s``, ``prefill_s`` and ``decode_s`` (D step to its
    first byte) are the router's (its ``Server-Timing`` header; None for a step not taken or
    without a router); ``end_wait_s`` is client-side, the last chunk to the stream's end, where
    the router holds ``[DONE]`` until the decode engine's holding report is in.
    """

    mode: str
    repeat: int
    history_tokens: int
    session: int
    turn: int
    tool_latency_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    reused_tokens: int | None = None
    kv_path: str | None = None
    decode_kv_usage: float | None = None
    decode_kv_tokens: int | None = None
    plan_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    end_wait_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def recomputed_tokens(self) -> int | None:
        """Prompt tokens some engine computed rather than reused."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens - (self.reused_tokens or 0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recomputed_tokens": self.recomputed_tokens}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


@dataclass(frozen=True)
class BenchResult:
    """A whole run: how it was configured (free-form, JSON-ready) and every turn's record."""

    config: dict[str, Any]
    records: tuple[TurnRecord, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "records": [r.to_dict() for r in self.records]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        return cls(data["config"], tuple(TurnRecord.from_dict(r) for r in data["records"]))
