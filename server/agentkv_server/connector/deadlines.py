"""A small table of keys with deadlines, for work that must not wait forever."""

from __future__ import annotations

__all__ = ["Deadlines"]


class Deadlines:
    """Deadlines by key; ``pop_overdue`` hands back (and forgets) the keys whose time is up.

    Times are plain floats from one clock (callers use ``time.monotonic()``); the table never
    reads a clock itself, which keeps it deterministic under test.
    """

    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._deadlines

    def __len__(self) -> int:
        return len(self._deadlines)

    def set(self, key: str, deadline: float) -> None:
        """Start tracking ``key``; an existing deadline is kept (the first one counts)."""
        self._deadlines.setdefault(key, deadline)

    def discard(self, key: str) -> None:
        """Stop tracking ``key``, if tracked."""
        self._deadlines.pop(key, None)

    def pop_overdue(self, now: float) -> list[str]:
        """Remove and return the keys whose deadline is at or before ``now``."""
        overdue = [key for key, deadline in self._deadlines.items() if deadline <= now]
        for key in overdue:
            del self._deadlines[key]
        return overdue
