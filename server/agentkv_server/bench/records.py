"""What the benchmark measures: one record per model call, as plain JSON-ready values."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Final, Literal

__all__ = [
    "REFUSAL_CODE",
    "Attempt",
    "BenchResult",
    "DecodeRecord",
    "Outcome",
    "PressureWindow",
    "RunWindow",
    "SweepResult",
    "TenantTurn",
    "TransferRecord",
    "TurnRecord",
]

# The error code of a router's refusal at arrival (503, Retry-After): the turn was not accepted.
REFUSAL_CODE: Final = "overloaded"

Outcome = Literal["served", "refused", "failed"]


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
class Attempt:
    """One HTTP try of a turn as the client saw it (a turn the client retried has several).

    ``status``: the answer's HTTP status (None: no answer, ``error`` names the exception);
    ``seconds``: from sending the try to its answer's headers (or to the error); ``code``: the
    error body's ``error.code``; ``retry_after_s`` and ``should_retry``: the ``Retry-After`` and
    ``x-should-retry`` headers, where sent; ``queue_s`` and ``queue_priority``: the router's
    ``queue`` entry of ``Server-Timing`` (how long the turn waited in its queue, and as what).
    """

    status: int | None
    seconds: float
    code: str | None = None
    retry_after_s: float | None = None
    should_retry: bool | None = None
    queue_s: float | None = None
    queue_priority: str | None = None
    error: str | None = None

    @property
    def refused(self) -> bool:
        """Refused at arrival: never accepted, so never a failed accepted turn."""
        return self.status == 503 and self.code == REFUSAL_CODE

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        return cls(**data)


@dataclass(frozen=True)
class TenantTurn:
    """A turn sent as an agent's client sends it (bench/tenant_runner.py): ``turn`` as the mode
    comparison records it, whose session it was (``label``: its tenant or kind; ``burst``: the
    burst it arrived in, None for sessions already running), the offered ``load`` of its run
    (x the stack's capacity; 0: the steady tenant alone; None outside the overload preset), and
    every HTTP try it took.
    """

    turn: TurnRecord
    label: str
    attempts: tuple[Attempt, ...] = ()
    burst: int | None = None
    load: float | None = None

    @property
    def outcome(self) -> Outcome:
        """``refused``: the last try was refused at arrival (the client gave up retrying);
        ``failed``: accepted and never answered."""
        if self.turn.ok:
            return "served"
        if self.attempts and self.attempts[-1].refused:
            return "refused"
        return "failed"

    @property
    def refusals(self) -> tuple[Attempt, ...]:
        return tuple(a for a in self.attempts if a.refused)

    @property
    def answered(self) -> Attempt | None:
        """The try answered with a stream: it says how long the turn waited in the queue."""
        return next((a for a in reversed(self.attempts) if a.status == 200), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "turn": self.turn.to_dict(),
            "label": self.label,
            "attempts": [asdict(a) for a in self.attempts],
            "burst": self.burst,
            "load": self.load,
            "outcome": self.outcome,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TenantTurn:
        return cls(
            TurnRecord.from_dict(data["turn"]),
            data["label"],
            tuple(Attempt.from_dict(a) for a in data.get("attempts", ())),
            data.get("burst"),
            data.get("load"),
        )


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
class RunWindow:
    """One run of planned sessions (bench/sweep.py): its mode, repeat and point (``tag``;
    ``load``, ``burst_size`` and ``offered_tokens_per_s`` where the point is an offered load),
    how many sessions it started, how long its sessions took, how long bench waited beforehand
    for an earlier run's KV to leave the decode engines, and what the mode's router counted
    meanwhile (None: no router, or a router without that counter)."""

    mode: str
    repeat: int
    tag: str
    sessions: int
    duration_s: float
    drained_s: float = 0.0
    load: float | None = None
    burst_size: int | None = None
    offered_tokens_per_s: float | None = None
    refused: float | None = None
    queued: float | None = None
    marked_down: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunWindow:
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


@dataclass(frozen=True)
class SweepResult:
    """A run of points of planned sessions (the overload and ``agents12`` presets): how it was
    configured (free-form, JSON-ready; ``measures`` names the preset's kind), every turn and
    every run's window."""

    config: dict[str, Any]
    turns: tuple[TenantTurn, ...]
    windows: tuple[RunWindow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "turns": [t.to_dict() for t in self.turns],
            "windows": [w.to_dict() for w in self.windows],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepResult:
        return cls(
            data["config"],
            tuple(TenantTurn.from_dict(t) for t in data["turns"]),
            tuple(RunWindow.from_dict(w) for w in data["windows"]),
        )
