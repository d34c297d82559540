"""How stub decode engines report holdings to a router, as agentkv's connector does: in the
same process (a coroutine) or over HTTP (``http_reporter``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from agentkv_server import wire

__all__ = ["Reporter", "deliver", "http_reporter"]

logger = logging.getLogger(__name__)

Reporter = Callable[[dict[str, Any]], Awaitable[None]]
"""Receives ``wire.holding_report(ticket, params)`` when a ticketed request finishes."""


def http_reporter(router_url: str, secret: str) -> tuple[Reporter, Callable[[], Awaitable[None]]]:
    """A reporter that POSTs to a router over HTTP, and the coroutine function that closes it."""
    session: aiohttp.ClientSession | None = None

    async def report(payload: dict[str, Any]) -> None:
        nonlocal session
        session = session or aiohttp.ClientSession()
        async with session.post(
            router_url.rstrip("/") + wire.REPORT_PATH,
            json=payload,
            headers={wire.SECRET_HEADER: secret},
        ) as response:
            response.raise_for_status()

    async def close() -> None:
        if session is not None:
            await session.close()

    return report, close


async def deliver(reporter: Reporter, payload: dict[str, Any], delay_s: float) -> None:
    """A report that fails is lost, as with a real connector: the router then has no holding."""
    await asyncio.sleep(delay_s)
    try:
        await reporter(payload)
    except Exception as exc:  # noqa: BLE001 - any failure of the reporter means the same
        logger.debug("holding report failed: %r", exc)
