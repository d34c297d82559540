"""What the benchmark measures: one record per model call, as plain JSON-ready values."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["BenchResult", "DecodeRecord", "PressureWindow", "TransferRecord", "TurnRecord"]


@dataclass(frozen=True)
class TurnRecord:
    """One turn of one session in one mode and repeat.

    Times are client-side: ``ttft_s`` runs from sending the request to the first streamed chunk,
    ``latency_s`` to the stream's end. ``reused_tokens`` is what the prefill engine pulled from a
    decode holder (router header ``x-agentkv-reused-tokens``) or, without a router, what the
    engine's prefix cache served (``usage.prompt_tokens_details.cached_tokens``); ``None`` when
    neither was reported. ``kv_reason``: why the router chose ``kv_path`` (docs/protocol.md
    section 3). ``decode_kv_usage`` is the decode engines' KV cache in use right after
    the turn (``vllm:kv_cache_usage_perc``, 0..1), ``decode_kv_tokens`` the same in tokens.

    The breakdown of a routed turn: ``plan_s``, ``prefill_s`` and ``decode_s`` (D step to its
    first byte) are the router's (its ``Server-Timing`` header; None for a step not taken or
    without a router); ``end_wait_s`` is client-side, the last chunk to the stream's end, where
    the router holds ``[DONE]`` until the decode engine's holding report is in.

    ``sent_s`` and ``ended_s``: when the request was sent and its stream ended, in seconds from
    the start of the run (the clairvoyant replays them). ``pressure_sessions``: in the pressure
    sweep, the number of sessions the turn's run had (its sweep point); None elsewhere.
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
    kv_reason: str | None = None
    decode_kv_usage: float | None = None
    decode_kv_tokens: int | None = None
    plan_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    end_wait_s: float | None = None
    sent_s: float | None = None
    ended_s: float | None = None
    pressure_sessions: int | None = None
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
class DecodeRecord:
    """One long-output request of a decoding session (the concurrency dimension).

    ``gaps_s`` are the client-side times between consecutive streamed chunks after the first:
    the inter-token latency its decoding saw while the agent sessions' turns were served
    beside it. A request still running when the agent sessions finish is cut there
    (``complete`` False); its gaps so far count. ``sent_s``: when the request was sent, on the
    clock of the turns' ``sent_s`` (its chunks arrived at ``sent_s + ttft_s`` plus the gaps so
    far, which places each gap beside the turns served then).
    """

    mode: str
    repeat: int
    history_tokens: int
    decoder: int
    request: int
    ttft_s: float | None = None
    gaps_s: tuple[float, ...] = ()
    complete: bool = False
    error: str | None = None
    sent_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gaps_s": list(self.gaps_s)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecodeRecord:
        names = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        return cls(**{**values, "gaps_s": tuple(values.get("gaps_s", ()))})


@dataclass(frozen=True)
class TransferRecord:
    """NIXL reads one role's engines made while one mode's sessions of one history length ran,
    and their summed duration, as the engines report them (bench/transfers.py)."""

    mode: str
    repeat: int
    history_tokens: int
    role: str
    reads: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferRecord:
        return cls(**data)


@dataclass(frozen=True)
class PressureWindow:
    """The decode engines over one run of the pressure sweep (bench/waits.py): requests that
    left their queue, those that waited over ``wait_threshold_s`` (for blocks), those that the
    router counted as kept waiting by holdings and their seconds of waiting (None without a
    router), preemptions, the most KV held, the KV cache's size, and how long bench waited
    beforehand for the previous run's retained KV to leave."""

    mode: str
    repeat: int
    sessions: int
    decode_requests: int | None = None
    waited_requests: int | None = None
    waited_beside_holdings: int | None = None
    waited_beside_holdings_s: float | None = None
    preemptions: int | None = None
    peak_kv_tokens: int | None = None
    peak_kv_fraction: float | None = None
    capacity_tokens: int | None = None
    block_size: int | None = None
    wait_threshold_s: float = 1.0
    drained_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PressureWindow:
        return cls(**data)


@dataclass(frozen=True)
class BenchResult:
    """A whole run: how it was configured (free-form, JSON-ready), every turn's record, with
    decoding sessions every one of their requests, the engines' KV transfer totals and, for
    the pressure sweep, the decode engines' memory per run."""

    config: dict[str, Any]
    records: tuple[TurnRecord, ...]
    decodes: tuple[DecodeRecord, ...] = ()
    transfers: tuple[TransferRecord, ...] = ()
    windows: tuple[PressureWindow, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "records": [r.to_dict() for r in self.records],
            "decodes": [d.to_dict() for d in self.decodes],
            "transfers": [t.to_dict() for t in self.transfers],
            "windows": [w.to_dict() for w in self.windows],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        return cls(
            data["config"],
            tuple(TurnRecord.from_dict(r) for r in data["records"]),
            tuple(DecodeRecord.from_dict(d) for d in data.get("decodes", ())),
            tuple(TransferRecord.from_dict(t) for t in data.get("transfers", ())),
            tuple(PressureWindow.from_dict(w) for w in data.get("windows", ())),
        )
