"""Ending sessions, the engines' report endpoint, and the bounded session index."""

from __future__ import annotations

from agentkv_server.testing import conversation


async def test_delete_session_releases_its_kv_on_the_decode_engine(make_router):
    router = await make_router()
    await router.chat(conversation(1, 300), session="s1")
    (held_id,) = router.decode[0].retained

    response = await router.client.delete("/v1/sessions/s1")

    assert response.status_code == 200
    assert response.json() == {
        "id": "s1",
        "object": "session.deleted",
        "deleted": True,
        "released": True,
        "released_tokens": 310,
    }
    assert router.decode[0].released == [held_id]
    release = router.decode[0].requests[-1]
    assert release.body["kv_transfer_params"] == {"agentkv_release": [held_id]}
    assert await router.state.store.count() == 0
    assert (await router.client.delete("/v1/sessions/s1")).status_code == 404


async def test_delete_unknown_or_invalid_session(make_router):
    router = await make_router()
    unknown = await router.client.delete("/v1/sessions/nobody")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "session_not_found"
    invalid = await router.client.delete("/v1/sessions/bad%20id")
    assert invalid.status_code == 400
    assert invalid.json()["error"]["code"] == "invalid_session_id"


async def test_session_ids_with_slashes_can_be_deleted(make_router):
    router = await make_router()
    await router.chat(conversation(1, 300), session="team/a:1")
    assert (await router.client.delete("/v1/sessions/team/a:1")).status_code == 200


async def test_report_from_a_turn_still_running_at_delete_is_released(make_router):
    router = await make_router()
    ticket = await router.state.keeper.issue(
        "s1", router.decode[0].url, "stub-model", 60.0, streamed=True
    )
    await router.chat(conversation(1, 300), session="s1")
    await router.client.delete("/v1/sessions/s1")

    late = {
        "remote_request_id": "late",
        "remote_num_tokens": 300,
        "agentkv_expires_in_seconds": 60.0,
    }
    await router.report({"ticket": ticket.ticket, "kv_transfer_params": late})
    await router.state.keeper.drain()

    assert await router.state.store.count() == 0
    assert router.decode[0].requests[-1].kv_params == {"agentkv_release": ["late"]}


async def test_report_endpoint_requires_the_secret(make_router):
    router = await make_router()
    payload = {"ticket": "t", "kv_transfer_params": {}}
    for headers in ({}, {"x-agentkv-secret": "wrong"}):
        response = await router.client.post(
            "/internal/v1/kv-holdings", json=payload, headers=headers
        )
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    response = await router.client.post(
        "/internal/v1/kv-holdings", json=payload, headers={"x-agentkv-secret": router.secret}
    )
    assert response.status_code == 204


async def test_malformed_report_is_refused(make_router):
    router = await make_router()
    response = await router.client.post(
        "/internal/v1/kv-holdings", json={"ticket": 1}, headers={"x-agentkv-secret": router.secret}
    )
    assert response.status_code == 400


async def test_index_is_bounded_and_evicted_holdings_are_released(make_router):
    router = await make_router(max_sessions=2)
    for session in ("a", "b", "c"):
        await router.chat(conversation(1, 300), session=session)
    await router.state.keeper.drain()

    assert await router.state.store.count() == 2
    assert await router.state.store.take("a") is None
    assert len(router.decode[0].released) == 1
    assert len(router.decode[0].retained) == 2


async def test_models_and_health(make_router):
    router = await make_router(n_prefill=2, n_decode=1)
    models = await router.client.get("/v1/models")
    assert models.json()["data"][0]["id"] == "stub-model"

    health = (await router.client.get("/health")).json()
    assert health["status"] == "ok" and health["store"] == "memory"
    assert [engine["url"] for engine in health["prefill"]] == [e.url for e in router.prefill]
