"""API keys, tenant namespaces, the shared secret, and header limits (docs/security.md)."""

from __future__ import annotations

import pytest

from agentkv_server.router.auth import tenant_id
from agentkv_server.settings import Settings
from agentkv_server.testing import conversation

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_openai_error(response, status: int, code: str | None) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code


@pytest.fixture
async def router(make_router):
    return await make_router(api_keys=[KEY_A, KEY_B])


def test_the_router_binds_loopback_unless_told_otherwise():
    assert Settings(decode_urls=("http://d:1",)).host == "127.0.0.1"


def test_short_api_keys_are_refused():
    with pytest.raises(ValueError, match="16 characters"):
        Settings(decode_urls=("http://d:1",), api_keys=["short"])


async def test_a_request_without_a_key_is_refused_before_any_engine(router):
    response = await router.chat(conversation(1, 10))

    assert_openai_error(response, 401, None)
    assert response.headers["www-authenticate"] == "Bearer"
    assert router.engine_requests() == 0


@pytest.mark.parametrize(
    "authorization", ["Bearer wrong-key-0123456789", f"Basic {KEY_A}", "Bearer", KEY_A]
)
async def test_a_wrong_key_is_refused(router, authorization):
    response = await router.chat(conversation(1, 10), headers={"authorization": authorization})

    assert response.status_code == 401
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert router.engine_requests() == 0


async def test_a_known_key_is_served_and_not_forwarded_to_engines(router):
    response = await router.chat(conversation(1, 10), headers=bearer(KEY_A))

    assert response.status_code == 200
    engine_headers = [r.headers for e in router.cluster.engines for r in e.requests]
    assert engine_headers and all("Authorization" not in h for h in engine_headers)


async def test_tenants_using_the_same_session_id_get_separate_holdings(router):
    await router.chat(conversation(1, 500), session="shared", headers=bearer(KEY_A))
    await router.chat(conversation(1, 300), session="shared", headers=bearer(KEY_B))

    assert await router.state.store.count() == 2
    second_a = await router.chat(conversation(2, 500), session="shared", headers=bearer(KEY_A))
    assert second_a.headers["x-agentkv-kv-path"] == "reuse"
    assert second_a.headers["x-agentkv-session-id"] == "shared"
    # A's first turn held 510 tokens (prompt 506 + 4 generated), B's 310.
    assert second_a.headers["x-agentkv-reused-tokens"] == "510"
    held_for_b = await router.state.store.take(f"{tenant_id(KEY_B)}#shared")
    assert held_for_b is not None and held_for_b.num_tokens == 310


async def test_deleting_a_session_touches_only_the_callers_own(router):
    await router.chat(conversation(1, 500), session="s1", headers=bearer(KEY_A))

    other = await router.client.delete("/v1/sessions/s1", headers=bearer(KEY_B))
    assert_openai_error(other, 404, "session_not_found")
    assert await router.state.store.count() == 1

    own = await router.client.delete("/v1/sessions/s1", headers=bearer(KEY_A))
    assert own.status_code == 200 and own.json()["id"] == "s1"
    assert await router.state.store.count() == 0


async def test_ending_a_session_needs_a_key(router):
    response = await router.client.delete("/v1/sessions/s1")
    assert_openai_error(response, 401, None)


async def test_a_tenant_key_does_not_open_the_engines_report_endpoint(router):
    payload = {"ticket": "t", "kv_transfer_params": {}}
    response = await router.client.post(
        "/internal/v1/kv-holdings", json=payload, headers=bearer(KEY_A)
    )
    assert_openai_error(response, 401, "invalid_secret")


async def test_metrics_need_the_secret_once_clients_authenticate(router):
    assert (await router.client.get("/metrics", headers=bearer(KEY_A))).status_code == 401
    assert (await router.client.get("/metrics")).status_code == 401
    as_header = await router.client.get("/metrics", headers={"x-agentkv-secret": router.secret})
    as_bearer = await router.client.get("/metrics", headers=bearer(router.secret))
    assert as_header.status_code == as_bearer.status_code == 200
    assert (await router.client.get("/health")).status_code == 200


async def test_without_keys_clients_are_one_anonymous_tenant(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1", headers=bearer("anything-at-all"))

    assert await router.state.store.take("s1") is not None
    assert (await router.client.get("/metrics")).status_code == 200
    forwarded = router.prefill[0].requests[-1].headers
    assert forwarded["Authorization"] == "Bearer anything-at-all"


async def test_too_many_headers_are_refused(make_router):
    router = await make_router(max_header_count=20)
    headers = {f"x-extra-{i}": "1" for i in range(30)}

    response = await router.chat(conversation(1, 10), headers=headers)

    assert_openai_error(response, 431, "request_header_fields_too_large")
    assert router.engine_requests() == 0


async def test_oversized_headers_are_refused(make_router):
    router = await make_router(max_header_bytes=2048)

    response = await router.chat(conversation(1, 10), headers={"x-big": "a" * 3000})
    long_path = await router.client.delete("/v1/sessions/" + "a" * 3000)

    assert_openai_error(response, 431, "request_header_fields_too_large")
    assert_openai_error(long_path, 431, "request_header_fields_too_large")
    assert router.engine_requests() == 0


async def test_an_overlong_session_id_in_the_path_is_refused(make_router):
    router = await make_router()
    response = await router.client.delete("/v1/sessions/" + "a" * 129)
    assert_openai_error(response, 400, "invalid_session_id")
