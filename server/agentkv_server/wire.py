"""Every name the router, the engines' connector and the launcher agree on, and its builders.

docs/protocol.md section 5 is the prose version of this module (the client <-> router names
live in ``agentkv.protocol``); keep the two in step. Standard library only: the router, the
connector (inside vLLM), the bundle, the bench, the test doubles and scripts all import it,
and it imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "API_KEYS_ENV",
    "BLOCK_HASHES",
    "CACHE_DIR_ENV",
    "CLIENT_BASE_URL_ENV",
    "CLIENT_LOGIT_BIAS_ENV",
    "CLIENT_MODEL_ENV",
    "DO_REMOTE_DECODE",
    "DO_REMOTE_PREFILL",
    "ENV_PREFIX",
    "EXPIRES_AT",
    "EXPIRES_IN_SECONDS",
    "EXTRA_DEAD_PEER_SECONDS",
    "EXTRA_DEMOTE_TRANSFER_THREADS",
    "EXTRA_HOST_TIER_BYTES",
    "EXTRA_IDLE_GRACE_MS",
    "EXTRA_IDLE_MAX_WAIT_MS",
    "EXTRA_IDLE_SLEEP_MS",
    "EXTRA_MAX_RETENTION_SECONDS",
    "EXTRA_NIXL_PROGRESS_DELAY_US",
    "EXTRA_PEER_PROBE_MS",
    "EXTRA_PULL_TIMEOUT_SECONDS",
    "EXTRA_REPORT_QUEUE_SIZE",
    "EXTRA_REPORT_TIMEOUT_SECONDS",
    "EXTRA_ROUTER_URL",
    "EXTRA_SECRET",
    "EXTRA_SYNC_LOAD_MAX_TOKENS",
    "EXTRA_SYNC_LOAD_TIMEOUT_MS",
    "HASH_BLOCK_SIZE",
    "HOST_TIER_TOKENS",
    "KV_BYTES_PER_TOKEN",
    "KV_CACHE_TOKENS",
    "KV_LOAD",
    "KV_LOAD_FAILED",
    "KV_LOAD_FROM",
    "KV_LOAD_OK",
    "KV_LOAD_SYNC",
    "KV_TRANSFER_PARAMS",
    "PORT_BASE_ENV",
    "RELEASE",
    "REMOTE_BLOCKS_EXPIRY_TIME",
    "REMOTE_BLOCK_IDS",
    "REMOTE_ENGINE_ID",
    "REMOTE_HOST",
    "REMOTE_NUM_TOKENS",
    "REMOTE_PORT",
    "REMOTE_REQUEST_ID",
    "RENEW",
    "REPORT_PATH",
    "REPORT_TICKET",
    "RETENTION_SECONDS",
    "ROUTER_URL_ENV",
    "SECRET_ENV",
    "SECRET_HEADER",
    "TAIL_TOKEN_IDS",
    "TICKET",
    "WAITED_BESIDE_RETAINED_SECONDS",
    "WAITED_FOR_BLOCKS_SECONDS",
    "cold_prefill_params",
    "decode_params",
    "holding_report",
    "is_housekeeping",
    "pull_prefill_params",
    "release_body",
    "renew_body",
    "renewed_params",
    "transfer_params",
]

# The request and response field that carries everything below.
KV_TRANSFER_PARAMS: Final = "kv_transfer_params"

# Upstream NixlConnector fields the router writes or reads (the rest pass through opaque).
DO_REMOTE_DECODE: Final = "do_remote_decode"
DO_REMOTE_PREFILL: Final = "do_remote_prefill"
REMOTE_ENGINE_ID: Final = "remote_engine_id"
REMOTE_BLOCK_IDS: Final = "remote_block_ids"
REMOTE_HOST: Final = "remote_host"
REMOTE_PORT: Final = "remote_port"
REMOTE_REQUEST_ID: Final = "remote_request_id"
REMOTE_NUM_TOKENS: Final = "remote_num_tokens"
# D's own perf_counter deadline: meaningless on other hosts (agentkv sends EXPIRES_* instead).
REMOTE_BLOCKS_EXPIRY_TIME: Final = "remote_blocks_expiry_time"

# agentkv's fields, all prefixed ``agentkv_``.
# Router -> D, with the decode step.
RETENTION_SECONDS: Final = "agentkv_retention_seconds"
TICKET: Final = "agentkv_ticket"
# Router -> D, on a tiny request of its own or with a decode step: free these retained
# requests' blocks now (as the request arrives, before it waits for blocks of its own).
RELEASE: Final = "agentkv_release"
# Router -> D, on a tiny request of its own: keep these retained requests' blocks at least this
# many seconds from now ({request id: seconds}; within the engine's maximum retention): the turn
# that will pull them waits in the router's queue for a busy prefill engine.
RENEW: Final = "agentkv_renew"
# D -> router, in the returned params and the holding report.
EXPIRES_IN_SECONDS: Final = "agentkv_expires_in_seconds"
# D -> P (opaque to the router): the retention deadline as Unix time, so that P's scheduler
# can skip a holding that is gone before it parks the request waiting for it.
EXPIRES_AT: Final = "agentkv_expires_at"
# D -> router, in the returned params and the holding report: the engine's whole KV cache in
# tokens (blocks x block size) and what one token of it occupies in bytes (per worker), from
# which the router keeps retained KV within a budget (docs/router.md, "Capacity").
KV_CACHE_TOKENS: Final = "agentkv_kv_cache_tokens"
KV_BYTES_PER_TOKEN: Final = "agentkv_kv_bytes_per_token"
# D -> router, beside the capacity, from an engine with a host tier below its KV cache: the
# tokens that tier holds. The KV of a holding released for room stays there until newer blocks
# push it out, and a turn continued on the engine loads it back (docs/router.md, "Capacity").
HOST_TIER_TOKENS: Final = "agentkv_host_tier_tokens"
# D -> P (opaque to the router): the held prefix's fingerprint (connector/prefix.py).
BLOCK_HASHES: Final = "agentkv_block_hashes"
HASH_BLOCK_SIZE: Final = "agentkv_hash_block_size"
TAIL_TOKEN_IDS: Final = "agentkv_tail_token_ids"
# Engine -> router, in the returned params and the holding report of a request that loaded KV
# from a remote engine (D reading P's prompt, or P pulling a holding): how that load ended,
# ``KV_LOAD_OK`` or ``KV_LOAD_FAILED`` (the request then computed the prompt itself), and the
# engine id it loaded from. Absent when the request loaded nothing remote.
KV_LOAD: Final = "agentkv_kv_load"
KV_LOAD_FROM: Final = "agentkv_kv_load_from"
KV_LOAD_OK: Final = "ok"
KV_LOAD_FAILED: Final = "failed"
# True when that load was synchronous: read before the step that computed the request
# (connector/syncload.py).
KV_LOAD_SYNC: Final = "agentkv_kv_load_sync"
# Engine -> router, in the returned params and the holding report of a request that waited for
# KV blocks before it was admitted: the seconds it waited, and those of them during which the
# engine retained blocks for later pulls that were neither released nor expired (the wait that
# retained KV caused: connector/blockwaits.py). Absent when it did not wait.
WAITED_FOR_BLOCKS_SECONDS: Final = "agentkv_waited_for_blocks_seconds"
WAITED_BESIDE_RETAINED_SECONDS: Final = "agentkv_waited_beside_retained_seconds"

# D -> router: the holding report of a ticketed request (streamed turns).
REPORT_PATH: Final = "/internal/v1/kv-holdings"
SECRET_HEADER: Final = "x-agentkv-secret"
REPORT_TICKET: Final = "ticket"

# The connector's keys in vLLM's ``kv_connector_extra_config`` (docs/connector.md).
EXTRA_ROUTER_URL: Final = "agentkv_router_url"
EXTRA_SECRET: Final = "agentkv_secret"
EXTRA_MAX_RETENTION_SECONDS: Final = "agentkv_max_retention_seconds"
EXTRA_REPORT_QUEUE_SIZE: Final = "agentkv_report_queue_size"
EXTRA_REPORT_TIMEOUT_SECONDS: Final = "agentkv_report_timeout_seconds"
EXTRA_PULL_TIMEOUT_SECONDS: Final = "agentkv_pull_timeout_seconds"
EXTRA_DEAD_PEER_SECONDS: Final = "agentkv_dead_peer_seconds"
EXTRA_PEER_PROBE_MS: Final = "agentkv_peer_probe_ms"
EXTRA_NIXL_PROGRESS_DELAY_US: Final = "agentkv_nixl_progress_delay_us"
EXTRA_DEMOTE_TRANSFER_THREADS: Final = "agentkv_demote_transfer_threads"
EXTRA_IDLE_GRACE_MS: Final = "agentkv_idle_grace_ms"
EXTRA_IDLE_SLEEP_MS: Final = "agentkv_idle_sleep_ms"
EXTRA_IDLE_MAX_WAIT_MS: Final = "agentkv_idle_max_wait_ms"
EXTRA_SYNC_LOAD_MAX_TOKENS: Final = "agentkv_sync_load_max_tokens"
EXTRA_SYNC_LOAD_TIMEOUT_MS: Final = "agentkv_sync_load_timeout_ms"
# The host tier's bytes beside the connector (bundle/launcher.py with_host_tier); 0: none.
EXTRA_HOST_TIER_BYTES: Final = "agentkv_host_tier_bytes"

# Environment variables. ``AGENTKV_<FIELD>`` sets any router setting; ``__`` reaches into a
# group: ``AGENTKV_RETENTION__MAX_S``.
ENV_PREFIX: Final = "AGENTKV_"
SECRET_ENV: Final = "AGENTKV_SECRET"
API_KEYS_ENV: Final = "AGENTKV_API_KEYS"
# Where an engine's connector sends holding reports (when its extra config names none).
ROUTER_URL_ENV: Final = "AGENTKV_ROUTER_URL"
PORT_BASE_ENV: Final = "AGENTKV_PORT_BASE"
CACHE_DIR_ENV: Final = "AGENTKV_CACHE_DIR"
# What the examples read (examples/_common.py): where to send requests, and for a random-weight
# test model the logit_bias that lets it write complete tool calls (a real model needs none).
CLIENT_BASE_URL_ENV: Final = "AGENTKV_BASE_URL"
CLIENT_MODEL_ENV: Final = "AGENTKV_MODEL"
CLIENT_LOGIT_BIAS_ENV: Final = "AGENTKV_TOOL_LOGIT_BIAS"

_COLD_PREFILL: Final[Mapping[str, Any]] = {
    DO_REMOTE_DECODE: True,
    DO_REMOTE_PREFILL: False,
    REMOTE_ENGINE_ID: None,
    REMOTE_BLOCK_IDS: None,
    REMOTE_HOST: None,
    REMOTE_PORT: None,
}


def cold_prefill_params() -> dict[str, Any]:
    """P's params for a turn with nothing to pull (step P, cold): a fresh dict."""
    return dict(_COLD_PREFILL)


def pull_prefill_params(holding: Mapping[str, Any]) -> dict[str, Any]:
    """P's params for a turn that pulls ``holding`` (D's returned params) from its holder."""
    return {**holding, DO_REMOTE_DECODE: True}


def decode_params(
    prefill: Mapping[str, Any] | None,
    *,
    retention_s: float | None,
    ticket: str | None,
    release: Sequence[str] = (),
) -> dict[str, Any]:
    """D's params: P's returned params plus agentkv's retention and ticket (None: not sent),
    and the retained requests D is to free as the step arrives (``release``)."""
    params = dict(prefill or {})
    if retention_s is not None:
        params[RETENTION_SECONDS] = retention_s
    if ticket is not None:
        params[TICKET] = ticket
    if release:
        params[RELEASE] = list(release)
    return params


def is_housekeeping(params: Mapping[str, Any]) -> bool:
    """Whether a request's params make it a release or renewal of its own (:func:`release_body`,
    :func:`renew_body`), not a decode step that also releases: plumbing, whose own KV is worth
    nothing."""
    return (RELEASE in params or RENEW in params) and RETENTION_SECONDS not in params


def release_body(model: str, request_ids: Sequence[str]) -> dict[str, Any]:
    """The tiny completion that asks a decode engine to free these retained requests now."""
    return _housekeeping(model, {RELEASE: list(request_ids)})


def renew_body(model: str, renewals: Mapping[str, float]) -> dict[str, Any]:
    """The tiny completion that asks a decode engine to keep these retained requests at least
    so many seconds from now."""
    return _housekeeping(model, {RENEW: dict(renewals)})


def renewed_params(params: Mapping[str, Any], seconds: float, *, now: float) -> dict[str, Any]:
    """A holding's params once its engine keeps it ``seconds`` from ``now`` (Unix time): its
    expiry fields moved by as much (upstream's is the engine's own clock: moved, not set)."""
    renewed = dict(params)
    expires_at = params.get(EXPIRES_AT)
    if isinstance(expires_at, (int, float)):
        shift = now + seconds - expires_at
        renewed[EXPIRES_AT] = now + seconds
        engine_clock = params.get(REMOTE_BLOCKS_EXPIRY_TIME)
        if isinstance(engine_clock, (int, float)):
            renewed[REMOTE_BLOCKS_EXPIRY_TIME] = engine_clock + shift
    return renewed


def _housekeeping(model: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "prompt": ".", "max_tokens": 1, KV_TRANSFER_PARAMS: params}


def holding_report(ticket: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The body D's connector posts to ``REPORT_PATH`` when a ticketed request finishes."""
    return {REPORT_TICKET: ticket, KV_TRANSFER_PARAMS: dict(params)}


def transfer_params(body: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's or answer's ``kv_transfer_params`` (empty when absent or not an object)."""
    params = (body or {}).get(KV_TRANSFER_PARAMS)
    return params if isinstance(params, dict) else {}
