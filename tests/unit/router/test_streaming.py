"""Streamed answers through a real uvicorn server on loopback: a client that leaves mid-stream
ends the engine's request at once (vLLM aborts a request whose connection closes), not when
the router's idle timeout would."""

from __future__ import annotations

import httpx

from agentkv_server.testing import StubCluster, conversation, in_process_router, serve_on_loopback
from agentkv_server.testing.conditions import eventually


async def test_a_client_leaving_mid_stream_ends_the_engine_request_at_once() -> None:
    cluster = StubCluster()
    try:
        # The engine sends two chunks, then nothing: only the client's leaving can end it here
        # (the router's own idle limit is a minute away).
        async with in_process_router(cluster, faults={"stall_s": 60.0}) as router:
            decode = router.state.decode.engines[0]
            router.decode[0].stall_after_chunks = 2
            body = {"model": "m", "messages": conversation(1, 50), "stream": True}
            async with serve_on_loopback(router.app) as url:
                async with (
                    httpx.AsyncClient(base_url=url, timeout=10) as client,
                    client.stream("POST", "/v1/chat/completions", json=body) as answer,
                ):
                    assert answer.status_code == 200
                    first = await anext(answer.aiter_raw())
                    assert first.startswith(b"data: ")
                    assert decode.inflight == 1
                await eventually(lambda: decode.inflight == 0, "ended on the engine", timeout_s=5.0)
    finally:
        await cluster.close()


async def test_a_stream_that_ends_leaves_nothing_in_flight() -> None:
    cluster = StubCluster()
    try:
        async with in_process_router(cluster) as router:
            body = {"model": "m", "messages": conversation(1, 50), "stream": True}
            async with (
                serve_on_loopback(router.app) as url,
                httpx.AsyncClient(base_url=url, timeout=10) as client,
            ):
                answer = await client.post("/v1/chat/completions", json=body)
            assert answer.text.rstrip().endswith("data: [DONE]")
            assert router.state.decode.engines[0].inflight == 0
    finally:
        await cluster.close()
