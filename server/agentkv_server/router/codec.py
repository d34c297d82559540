"""JSON in and out of the router: orjson on the hot path, the standard library where orjson
refuses what the standard library reads or writes.

orjson parses and serializes a turn's bodies several times faster than ``json``
(docs/router.md, "Hot path"), but refuses integers beyond 64 bits, lone surrogates, and text
that is not UTF-8. For those the standard library runs as before, so what the router accepts,
answers and the errors it names stay the same.

Both writers recurse: orjson refuses more than 254 levels of nesting, and the standard library
runs out of Python's stack a little before 1000, while both readers take up to about 1000. A
body is therefore checked with :func:`nested_deeper` as it is read (intake.py), so that every
body the router accepts it can also write (docs/security.md, "Limits on input").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import JSONResponse

__all__ = ["JSONBytesResponse", "dumps", "loads", "nested_deeper"]


def loads(raw: bytes | str, *, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(raw, parse_constant=...)``: the same value, or the same error."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw, parse_constant=parse_constant)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits, a lone surrogate
        return json.dumps(value, separators=(",", ":")).encode()


def nested_deeper(value: Any, raw: bytes, limit: int) -> bool:
    """Whether ``value`` (parsed from ``raw``) nests objects and arrays deeper than ``limit``.

    ``limit`` levels need at least ``limit`` opening brackets in ``raw``, a count C code makes
    at memory speed; only the rare body with more is walked, without recursion.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    pending: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while pending:
        node, depth = pending.pop()
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                pending.append((child, depth + 1))
    return False


class JSONBytesResponse(JSONResponse):
    """Starlette's JSONResponse, serialized by :func:`dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
