"""NIXL progress threads that sleep between events instead of spinning.

NIXL's UCX backend runs a progress thread that waits in ``poll()`` on the UCX workers' event
descriptors, with the agent's ``pthrDelay`` as the timeout: it wakes at once when a transfer
or a notification needs it, and after ``pthrDelay`` in any case. NIXL's python agent sets
``pthrDelay = 0`` (``nixl._api``, not configurable), so the thread calls ``poll(..., 0)`` in
a loop: a core per engine for the engine's lifetime (docs/connector.md, "Idle engines").

The thread cannot simply be switched off: a read over UCX's shared-memory and TCP transports
completes only while the *holder's* worker progresses too, and a decode engine that only
holds KV does not step often (measured: with no thread, a read from an agent that did not
poll never finished). With a delay the thread stays, and idles.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["delayed_config_class", "nixl_progress_delay"]


@contextlib.contextmanager
def nixl_progress_delay(delay_us: int) -> Iterator[None]:
    """While the block runs, NIXL agents are created with ``pthrDelay`` at least ``delay_us``.

    vLLM builds its agent inside the NIXL worker's constructor, and NIXL's agent builds its
    native config there and sets the delay to 0; the block swaps in a subclass of that config
    class that raises the delay, and puts the original back on exit.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    agent_class = base_worker.NixlWrapper
    if agent_class is None or delay_us <= 0:  # NIXL missing: upstream raises its own error
        yield
        return
    bindings = sys.modules[agent_class.__module__].nixlBind
    original = bindings.nixlAgentConfig
    bindings.nixlAgentConfig = delayed_config_class(original, delay_us)
    try:
        yield
    finally:
        bindings.nixlAgentConfig = original


def delayed_config_class(config_class: type[Any], delay_us: int) -> type[Any]:
    """A subclass of NIXL's native ``nixlAgentConfig`` whose ``pthrDelay`` (microseconds) is
    never set below ``delay_us``."""
    native = config_class.__dict__["pthrDelay"]  # the binding's own property

    class DelayedAgentConfig(config_class):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(native.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            native.__set__(self, max(int(value), delay_us))

    return DelayedAgentConfig
