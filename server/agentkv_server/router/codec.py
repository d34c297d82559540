"""JSON in and out of the router: orjson on the hot path, the standard library where orjson
refuses what the standard library reads or writes.

orjson parses and serializes a turn's bodies several times faster than ``json``
(docs/router.md, "Hot path"), but refuses integers beyond 64 bits, lone surrogates, and text
that is not UTF-8. For those the standard library runs as before, so what the router accepts,
answers and the errors it names stay the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import JSONResponse

__all__ = ["JSONBytesResponse", "dumps", "loads"]


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


class JSONBytesResponse(JSONResponse):
    """Starlette's JSONResponse, serialized by :func:`dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
