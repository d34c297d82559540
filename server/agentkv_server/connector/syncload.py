"""Synchronous loads: a decode engine reads a few of P's blocks before the step that uses them.

vLLM starts an asynchronous load after its step's forward pass and schedules the request in a
later step, once a poll has seen the read done. For D reading the new part of a follow-up from
a prefill engine it has read from before, the read is a few blocks over a live connection,
done by the first poll (0.1 ms median here); what the request waits for is the step. A load
the scheduler half declares synchronous is started before the forward pass and computed in
the same step: one decode step (30-45 ms on this CPU) less per turn. The worker half waits for
its reads there, at most ``sync_load_timeout_seconds``; a read not done by then fails its
blocks, which vLLM's ``recompute`` policy computes in place (docs/connector.md, "Synchronous
loads").

The two halves agree through one attribute of the step's connector metadata.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["mark_sync_loads", "sync_loads_of"]

_ATTR: Final = "agentkv_sync_loads"


def mark_sync_loads(metadata: Any, req_ids: set[str]) -> None:
    """Tell the worker half which of this step's loads the scheduler scheduled at once."""
    setattr(metadata, _ATTR, frozenset(req_ids))


def sync_loads_of(metadata: Any) -> frozenset[str]:
    """The requests whose loads this step's forward pass needs done (none if unmarked)."""
    return getattr(metadata, _ATTR, frozenset())
