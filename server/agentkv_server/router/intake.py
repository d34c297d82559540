"""Reading a client's request: size limit, JSON, required fields, session id, turn hints.

Everything here runs before any engine is contacted, so bad input is refused with a 4xx and
never reaches one. The parsed request carries a body already stripped of agentkv's own fields
(docs/protocol.md sections 1-2) and of any client-supplied ``kv_transfer_params``, which only
the router may set.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from agentkv import protocol
from agentkv_server import wire
from agentkv_server.router import codec
from agentkv_server.router.auth import session_key
from agentkv_server.router.errors import ClientGone, RouterError
from agentkv_server.router.formats import Endpoint, invalid_parameter, wire_format
from agentkv_server.router.turn import TurnHints

__all__ = ["ClientRequest", "Endpoint", "read_json", "read_request"]

# Body fields the router consumes; engines never see them.
_STRIPPED_FIELDS = (protocol.BODY_FIELD, *protocol.SESSION_ID_BODY_FIELDS, wire.KV_TRANSFER_PARAMS)
# Client headers worth passing on to engines (an engine started with --api-key checks it).
_FORWARDED_HEADERS = ("authorization",)
# RFC 9110 5.5: no control characters but tab in a field value (an engine's HTTP parser refuses them).
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_TRUE, _FALSE = frozenset({"1", "true", "yes"}), frozenset({"0", "false", "no"})


@dataclass(frozen=True)
class ClientRequest:
    """A validated client request, ready to forward."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    session_id: str | None
    hints: TurnHints
    headers: dict[str, str]
    tenant: str | None = None
    body_bytes: int = 0
    """The body's size as it arrived: what a prompt not yet counted is estimated by."""

    @property
    def session_key(self) -> str | None:
        """The session's key in the store: the client's id within its tenant's namespace."""
        return None if self.session_id is None else session_key(self.tenant, self.session_id)


async def read_request(
    request: Request,
    endpoint: Endpoint,
    max_body_bytes: int,
    tenant: str | None = None,
    *,
    max_json_depth: int,
) -> ClientRequest:
    """Parse and validate ``request``; raises :class:`RouterError` (4xx) on bad input, and
    :class:`ClientGone` when the client left before its body ended.

    ``tenant`` (the authenticated caller) namespaces the session id. When the router
    authenticates clients their ``authorization`` header is its own and is not forwarded.
    """
    raw = await _read_body(request, max_body_bytes)
    body = _parse_json(raw, max_json_depth)
    wire = wire_format(endpoint)
    wire.check(body)
    hints = _resolve_hints(request.headers, body.get(protocol.BODY_FIELD))
    session_id = _resolve_session_id(request.headers, body)
    for name in (*_STRIPPED_FIELDS, *wire.dropped_fields):
        body.pop(name, None)
    headers = _forwarded_headers(request.headers) if tenant is None else {}
    return ClientRequest(
        endpoint=endpoint,
        body=body,
        model=body["model"],
        stream=bool(body.get("stream", False)),
        session_id=session_id,
        hints=hints,
        headers=headers,
        tenant=tenant,
        body_bytes=len(raw),
    )


def _forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    forwarded = {name: headers[name] for name in _FORWARDED_HEADERS if name in headers}
    for name, value in forwarded.items():
        if _CONTROL_CHARACTERS.search(value):
            raise invalid_parameter(name, "control characters in a header value")
    return forwarded


async def read_json(request: Request, max_body_bytes: int, max_json_depth: int) -> dict[str, Any]:
    """The request's body as a JSON object, read up to ``max_body_bytes`` (413 beyond) and
    nested at most ``max_json_depth`` deep (400 beyond)."""
    return _parse_json(await _read_body(request, max_body_bytes), max_json_depth)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):  # not "²", which int() refuses
            raise RouterError(400, "Invalid Content-Length header.", code="invalid_request")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone("body") from None
    return b"".join(chunks)


def _too_large(limit: int) -> RouterError:
    return RouterError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")


def _parse_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    # ValueError also covers undecodable bytes, NaN/Infinity (not JSON, and engines refuse
    # them) and integers past Python's digit limit; RecursionError, nesting past what the
    # standard library reads (about 1000 levels).
    try:
        body = codec.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:
        raise RouterError(
            400, f"Request body is not valid JSON: {_short(exc)}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise RouterError(400, "Request body must be a JSON object.", code="invalid_json")
    if codec.nested_deeper(body, raw, max_depth):  # the router could not write it again
        raise _too_deep(max_depth)
    return body


def _too_deep(limit: int) -> RouterError:
    return RouterError(
        400,
        f"Request body is not valid JSON: objects and arrays nested deeper than {limit} levels.",
        code="invalid_json",
    )


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


def _resolve_session_id(headers: Mapping[str, str], body: dict[str, Any]) -> str | None:
    """First match over every convention in docs/protocol.md section 1, then ``agentkv.session_id``."""
    candidates: list[tuple[str, object]] = [
        (name, headers[name]) for name in protocol.SESSION_ID_HEADERS if name in headers
    ]
    candidates += [(name, body[name]) for name in protocol.SESSION_ID_BODY_FIELDS if name in body]
    meta = body.get(protocol.BODY_FIELD)
    if isinstance(meta, dict) and "session_id" in meta:
        candidates.append((f"{protocol.BODY_FIELD}.session_id", meta["session_id"]))
    if not candidates:
        return None
    source, value = candidates[0]
    if not isinstance(value, str) or not protocol.is_valid_session_id(value):
        raise RouterError(
            400,
            f"Invalid session id in '{source}': 1-{protocol.SESSION_ID_MAX_LENGTH} characters "
            "of [A-Za-z0-9._:@/+=-] expected.",
            param=source,
            code="invalid_session_id",
        )
    return value


_HINT_HEADERS = {
    "turn": protocol.HEADER_TURN,
    "tool_continuation": protocol.HEADER_TOOL_CONTINUATION,
    "next_turn_seconds": protocol.HEADER_NEXT_TURN_SECONDS,
    "session_end": protocol.HEADER_SESSION_END,
    "version": protocol.HEADER_VERSION,
}


def _resolve_hints(headers: Mapping[str, str], meta: object) -> TurnHints:
    """Turn hints from headers and the body object; headers win where both are present."""
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise invalid_parameter(protocol.BODY_FIELD, "must be an object")
    values: dict[str, Any] = {}
    for name, header in _HINT_HEADERS.items():
        if header in headers:
            values[name] = _from_header(name, header, headers[header])
        elif meta.get(name) is not None:
            values[name] = _from_body(name, meta[name])
    return TurnHints(**values)


def _from_header(name: str, header: str, raw: str) -> Any:
    text = raw.strip().lower()
    try:
        if name in ("tool_continuation", "session_end"):
            if text not in _TRUE | _FALSE:
                raise ValueError(raw)
            return text in _TRUE
        if name == "turn":
            return _check_turn(int(text))
        if name == "next_turn_seconds":
            return _check_seconds(float(text))
    except ValueError:
        raise invalid_parameter(header, f"cannot read {raw!r}") from None
    return raw


def _from_body(name: str, value: object) -> Any:
    param = f"{protocol.BODY_FIELD}.{name}"
    expected: dict[str, type | tuple[type, ...]] = {
        "turn": int,
        "tool_continuation": bool,
        "session_end": bool,
        "next_turn_seconds": (int, float),
        "version": str,
    }
    wrong_bool = isinstance(value, bool) and name in ("turn", "next_turn_seconds")
    if not isinstance(value, expected[name]) or wrong_bool:
        raise invalid_parameter(param, f"unexpected value {value!r}")
    try:
        if name == "turn":
            return _check_turn(value)  # type: ignore[arg-type]
        if name == "next_turn_seconds":
            return _check_seconds(float(value))  # type: ignore[arg-type]
    except ValueError:
        raise invalid_parameter(param, f"unexpected value {value!r}") from None
    return value


def _check_turn(turn: int) -> int:
    if turn < 1:
        raise ValueError(turn)
    return turn


def _check_seconds(seconds: float) -> float:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(seconds)
    return seconds
