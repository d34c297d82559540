"""One turn's state as the orchestrator serves it: the client's hints, the KV path, the errors.

A turn starts on its plan's path (``recompute`` without a plan): ``local``, ``pull``, or
``fallback`` when the holder cannot answer. A planned ``local`` or ``pull`` that fails moves once
more, to ``fallback`` (:meth:`Turn.fall_back`). The path's value is its wire name (the
``x-agentkv-kv-path`` header and the ``path`` label of ``agentkv_turns_total``, docs/protocol.md
section 3).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentkv import protocol
from agentkv_server.router.formats import WireFormat, wire_format
from agentkv_server.router.queue import Priority

if TYPE_CHECKING:
    from agentkv_server.router.intake import ClientRequest
    from agentkv_server.router.upstream import EngineFailure

__all__ = ["KVPath", "Turn", "TurnHints"]


class KVPath(str, enum.Enum):
    """Where a turn's history KV comes from."""

    LOCAL = "local"
    """Continued on the decode engine that holds it: no prefill step, no transfer."""
    PULL = "reuse"
    """Pulled by a prefill engine from its decode holder."""
    RECOMPUTE = "recompute"
    FALLBACK = "fallback"
    """A planned local turn or pull failed: recomputed instead."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TurnHints:
    """What the client told the router about this turn (docs/protocol.md section 2)."""

    turn: int | None = None
    tool_continuation: bool = False
    next_turn_seconds: float | None = None
    session_end: bool = False
    version: str | None = None


@dataclass(slots=True)
class Turn:
    """What the router knows about one turn as it goes (what it planned: ``Plan``)."""

    request: ClientRequest
    started: float
    path: KVPath = KVPath.RECOMPUTE
    reused_tokens: int = 0
    computed_tokens: int = 0
    prompt_tokens: int | None = None
    """The prompt's tokens as P counted them (the decode step's size); None before P answers."""
    failures: list[EngineFailure] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per step, for the breakdown: plan, prefill, decode (to first byte), report."""
    added_itl_s: float | None = None
    """A local turn's predicted delay per decode step of the holder's other sequences."""
    reason: str | None = None
    """Why the plan chose its path (the ``reason`` label of ``agentkv_path_decisions_total``,
    or why it had none to use: ``released_*``, ``none_held``, ``holder_silent``); None
    without a session."""
    deadline: float = math.inf
    """Monotonic time by which its first token is due (``timeouts.first_token_s``)."""
    priority: Priority = Priority.NEW
    """Its place in the router's queue for prefill engines (admission.py)."""

    def remaining_s(self) -> float:
        """Seconds left before the deadline (0 once past it)."""
        return max(self.deadline - time.monotonic(), 0.0)

    @property
    def wire(self) -> WireFormat:
        return wire_format(self.request.endpoint)

    @property
    def pulls(self) -> bool:
        """The prefill step pulls the holding (planned, or done once the step succeeded)."""
        return self.path is KVPath.PULL

    @property
    def local(self) -> bool:
        return self.path is KVPath.LOCAL

    def fall_back(self) -> None:
        """A planned local turn or pull failed: the turn recomputes."""
        self.path = KVPath.FALLBACK

    def headers(self) -> dict[str, str]:
        headers = {
            protocol.HEADER_KV_PATH: self.path.value,
            protocol.HEADER_REUSED_TOKENS: str(self.reused_tokens),
            protocol.HEADER_SERVER_TIMING: self.server_timing(),
        }
        if self.request.session_id is not None:
            headers[protocol.HEADER_RESPONSE_SESSION_ID] = self.request.session_id
        return headers

    def server_timing(self) -> str:
        """The phases so far as an HTTP ``Server-Timing`` value (milliseconds; the plan's
        reason and the queue's priority as their ``desc``), and a local turn's predicted stall
        of the holder's other sequences per decode step."""
        entries = []
        for name, seconds in self.phases.items():
            entry = f"{name};dur={seconds * 1000:.1f}"
            if name == "plan" and self.reason is not None:
                entry += f';desc="{self.reason}"'
            elif name == "queue":
                entry += f';desc="{self.priority.label}"'
            entries.append(entry)
        if self.added_itl_s is not None:
            entries.append(f"stall;dur={self.added_itl_s * 1000:.1f}")
        return ", ".join(entries)

    def breakdown(self) -> str:
        return " ".join([f"{name}={s * 1000:.1f}ms" for name, s in self.phases.items()])
