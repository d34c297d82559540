"""A small concurrent load through the in-process router: every turn answered correctly, and the
session index (and the KV the decode engines keep for it) stays within its bound.

The full-size run with figures is ``agentkv bench router --only sessions --concurrency 32``.
"""

from __future__ import annotations

from typing import Any

from agentkv_server.testing import InProcessRouter, run_sessions

INDEX_BOUND = 10


def sender(router: InProcessRouter):
    async def send(session: str, body: dict[str, Any]):
        response = await router.client.post(
            "/v1/chat/completions", json=body, headers={"x-session-id": session}
        )
        answer = response.json() if response.status_code == 200 else None
        return response.status_code, response.headers, answer

    return send


async def test_concurrent_sessions_are_served_correctly_within_a_bounded_index(make_router):
    router = await make_router(n_decode=2, max_sessions=INDEX_BOUND)
    held: list[int] = []

    async def watch_index() -> None:
        held.append(await router.state.store.count())

    report = await run_sessions(
        sender(router), sessions=40, turns=3, concurrency=8, after_turn=watch_index
    )
    await router.cluster.flush_reports()
    await router.state.keeper.drain()

    assert (report.sent, report.succeeded, report.correct) == (120, 120, 120)
    assert report.paths()["reuse"] > 0  # the KV path ran under load, not only recomputes
    assert max(held) <= INDEX_BOUND
    retained = sum(len(engine.retained) for engine in router.decode)
    assert retained == await router.state.store.count() <= INDEX_BOUND
