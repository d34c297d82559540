"""The KV size D's connector returns with every holding (the router's budget, docs/router.md,
"Capacity")."""

from __future__ import annotations

from types import SimpleNamespace

from agentkv_server.connector import AgentKVConnector
from agentkv_server.connector.capacity import capacity_params
from agentkv_server.connector.scheduler import AgentKVScheduler
from agentkv_server.connector.settings import ConnectorSettings

BLOCK = 16
# SmolLM2-135M in fp32: 30 layers, 3 KV heads of 64, keys and values: 1536 bytes per token
# and layer, 46 080 per token.
PAGE = 2 * BLOCK * 3 * 64 * 4


def smollm_cache(num_blocks: int) -> SimpleNamespace:
    spec = SimpleNamespace(page_size_bytes=PAGE, block_size=BLOCK)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"layer.{i}" for i in range(30)])
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[group])


def test_capacity_is_the_cache_in_tokens_and_bytes_per_token():
    assert capacity_params(smollm_cache(1456), BLOCK) == {
        "agentkv_kv_cache_tokens": 1455 * BLOCK,  # one block is vLLM's null block
        "agentkv_kv_bytes_per_token": 46_080.0,
    }


def test_a_host_tier_is_reported_in_tokens_of_this_engines_kv():
    params = capacity_params(smollm_cache(1456), BLOCK, host_tier_bytes=46_080 * 10_000)
    assert params["agentkv_host_tier_tokens"] == 10_000
    assert ConnectorSettings.from_extra_config({"agentkv_host_tier_bytes": 5}).host_tier_bytes == 5


def test_a_config_without_sizes_reports_nothing():
    assert capacity_params(SimpleNamespace(num_blocks=None, kv_cache_groups=[]), BLOCK) == {}
    assert capacity_params(SimpleNamespace(num_blocks=1, kv_cache_groups=[]), BLOCK) == {}


def test_a_retained_request_returns_the_engines_capacity():
    scheduler = object.__new__(AgentKVScheduler)
    scheduler._settings = ConnectorSettings()
    scheduler.block_size = BLOCK
    scheduler._capacity = capacity_params(smollm_cache(1456), BLOCK)
    scheduler._reqs_need_send, scheduler._reqs_in_batch, scheduler._retained = {}, set(), set()
    scheduler._deadlines = {}
    request = SimpleNamespace(request_id="turn-1", all_token_ids=list(range(40)))
    params = {"do_remote_decode": True, "remote_num_tokens": 40}

    kept = scheduler._retain(request, params, {"agentkv_retention_seconds": 30.0})

    assert kept
    assert params["agentkv_kv_cache_tokens"] == 1455 * BLOCK
    assert params["agentkv_kv_bytes_per_token"] == 46_080.0


# -- a request short of blocks waits for the frees already coming ------------------------------


def retaining(deadlines: dict[str, float]) -> AgentKVScheduler:
    scheduler = object.__new__(AgentKVScheduler)
    scheduler._retained = set(deadlines)
    scheduler._deadlines = dict(deadlines)
    return scheduler


def test_released_blocks_not_freed_yet_are_a_pending_free(monkeypatch):
    monkeypatch.setattr("time.perf_counter", lambda: 100.0)
    assert retaining({"released": 99.9, "kept": 400.0}).has_pending_block_frees()


def test_blocks_still_retained_or_freed_long_ago_are_not(monkeypatch):
    monkeypatch.setattr("time.perf_counter", lambda: 100.0)
    assert not retaining({"kept": 400.0}).has_pending_block_frees()
    assert not retaining({"stale": 90.0}).has_pending_block_frees()  # no free coming after all


def test_freed_blocks_are_no_longer_pending(monkeypatch):
    monkeypatch.setattr("time.perf_counter", lambda: 100.0)
    scheduler = retaining({"released": 99.9})
    scheduler._retained.clear()  # the worker reported it sent or freed

    assert not scheduler.has_pending_block_frees()
    assert scheduler._deadlines == {}


def test_a_release_makes_a_pending_free(monkeypatch):
    monkeypatch.setattr("time.perf_counter", lambda: 100.0)
    scheduler = retaining({"held": 400.0})
    scheduler._reqs_need_send = {}

    scheduler._release("held")

    assert scheduler.has_pending_block_frees()
    assert scheduler._reqs_need_send == {"held": 100.0}


def test_the_connector_tells_vllm_of_pending_frees(monkeypatch):
    monkeypatch.setattr("time.perf_counter", lambda: 100.0)
    connector = object.__new__(AgentKVConnector)
    connector.connector_scheduler = retaining({"released": 99.9})
    assert connector.has_pending_block_frees()
    connector.connector_scheduler = None  # the worker's half
    assert not connector.has_pending_block_frees()


# -- a holding whose turn waits in the router's queue is kept longer ----------------------------


def test_a_renewal_moves_a_retained_requests_deadline_later(monkeypatch):
    monkeypatch.setattr("time.perf_counter", lambda: 100.0)
    scheduler = retaining({"held": 110.0})
    scheduler._reqs_need_send = {}
    scheduler._settings = ConnectorSettings(max_retention_seconds=480.0)

    scheduler._renew("held", 60.0)

    assert scheduler._reqs_need_send == {"held": 160.0}  # the worker takes it next step
    assert scheduler._deadlines["held"] == 160.0


def test_a_renewal_never_shortens_nor_revives_nor_passes_the_maximum(monkeypatch):
    monkeypatch.setattr("time.perf_counter", lambda: 100.0)
    scheduler = retaining({"long": 300.0, "released": 100.0, "expired": 90.0, "capped": 110.0})
    scheduler._retained.add("gone-from-deadlines")
    scheduler._reqs_need_send = {}
    scheduler._settings = ConnectorSettings(max_retention_seconds=120.0)

    for req_id in ("long", "released", "expired", "unknown", "gone-from-deadlines"):
        scheduler._renew(req_id, 60.0)
    scheduler._renew("capped", 1000.0)

    assert scheduler._reqs_need_send == {"capped": 220.0}
    assert scheduler._deadlines["long"] == 300.0 and scheduler._deadlines["released"] == 100.0


def test_a_renewal_request_is_read_from_its_params():
    from agentkv_server.connector.params import renewals

    assert renewals({"agentkv_renew": {"a": 30, "b": 1.5}}) == {"a": 30.0, "b": 1.5}
    assert renewals({"agentkv_renew": {"a": -1, "b": "x", "c": True}}) == {}
    assert renewals({"agentkv_renew": ["a"]}) == {} and renewals(None) == {}
