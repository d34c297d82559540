"""The connector's readers of agentkv's fields in ``kv_transfer_params`` (docs/protocol.md section 5).

The names live in ``agentkv_server.wire``; upstream NixlConnector fields pass through
untouched. These functions are the connector's only readers of router-supplied values, and
they never raise on bad input: a malformed hint falls back to upstream behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from agentkv_server.connector.log import get_logger
from agentkv_server.wire import EXPIRES_AT, RELEASE, RENEW, RETENTION_SECONDS, TICKET

__all__ = [
    "expires_within",
    "release_ids",
    "renewals",
    "retention_seconds",
    "ticket",
]

logger = get_logger(__name__)


def retention_seconds(params: Mapping[str, Any], *, default: float, maximum: float) -> float:
    """How long to retain a finished request's blocks: the request's own hint, clamped to
    ``[0, maximum]``, or ``default`` (also clamped) when it gives none or an unusable one."""
    value = params.get(RETENTION_SECONDS)
    if value is None:
        return min(default, maximum)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if math.isnan(seconds):
        logger.warning("Ignoring unusable %s=%r", RETENTION_SECONDS, value)
        return min(default, maximum)
    return min(max(seconds, 0.0), maximum)


def expires_within(params: Mapping[str, Any], seconds: float, *, now: float) -> bool:
    """True when the holding's ``agentkv_expires_at`` falls before ``now + seconds``.

    Wall clocks of two hosts differ a little; a skew only moves when P gives up on a holding.
    P's worker still checks upstream's clock-corrected deadline before any read.
    """
    try:
        deadline = float(params[EXPIRES_AT])
    except (KeyError, TypeError, ValueError):
        return False
    return deadline <= now + seconds


def release_ids(params: Mapping[str, Any] | None) -> list[str]:
    """Request ids whose retained blocks this request asks to free (empty when none)."""
    value = (params or {}).get(RELEASE)
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, list | tuple):
        logger.warning("Ignoring %s that is not a list of request ids: %r", RELEASE, value)
        return []
    return [str(req_id) for req_id in value]


def renewals(params: Mapping[str, Any] | None) -> dict[str, float]:
    """Retained request ids this request asks to keep longer, and for how many seconds from
    now (empty when none; unusable entries are skipped)."""
    value = (params or {}).get(RENEW)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        logger.warning("Ignoring %s that is not an object of request ids: %r", RENEW, value)
        return {}
    kept = {}
    for req_id, seconds in value.items():
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0:
            kept[str(req_id)] = float(seconds)
        else:
            logger.warning(
                "Ignoring %s for %s: %r is not a positive number", RENEW, req_id, seconds
            )
    return kept


def ticket(params: Mapping[str, Any] | None) -> str | None:
    """The router's ticket for this request's holding report, if it asked for one."""
    value = (params or {}).get(TICKET)
    return str(value) if value else None
