"""The connector's own settings, read once from ``kv_connector_extra_config`` and the environment.

Upstream NixlConnector keys (``bidirectional_kv_xfer``, ``decoder_kv_blocks_ttl``,
``num_threads``, ...) keep their meaning; agentkv's keys are prefixed ``agentkv_`` so the two
never collide.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from agentkv_server import wire
from agentkv_server.errors import ConfigError

__all__ = ["DEFAULT_RETENTION_SECONDS", "ConnectorSettings"]

# Upstream's ``decoder_kv_blocks_ttl`` default: how long D keeps a finished request's blocks.
DEFAULT_RETENTION_SECONDS: Final = 480.0


@dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    """Everything ``AgentKVConnector`` adds to NixlConnector's configuration.

    ``default_retention_seconds`` applies when a request names no retention; requests may ask
    for less or more, up to ``max_retention_seconds``. ``pull_timeout_seconds`` (plus the
    pull's size at ``worker.PULL_FLOOR_BYTES_PER_SECOND``) bounds how long an engine waits for one
    pull (handshake and read) before it recomputes instead; a peer whose transfer failed or
    stalled gets no handshake, read or heartbeat for ``dead_peer_seconds``; the
    handshake listener of each peer a read is waiting on is probed every ``peer_probe_seconds``
    (``peers.py``; 0 turns that off). An engine with nothing to compute for
    ``idle_grace_seconds`` waits ``idle_sleep_seconds`` per step, growing up to
    ``idle_max_wait_seconds`` while new requests can end the wait (``idle.py``; a sleep of 0
    turns that off). NIXL's progress thread sleeps up to ``nixl_progress_delay_us`` between UCX
    events (``progress.py``; 0 is NIXL's own busy poll); ``demote_transfer_threads`` moves the
    threads NIXL starts to ``SCHED_IDLE`` (``affinity.py``). A decode engine loads up to
    ``sync_load_max_tokens`` from a prefill engine it has loaded from before synchronously,
    waiting at most ``sync_load_timeout_seconds`` for the read (``syncload.py``; 0 tokens turns
    that off).
    """

    default_retention_seconds: float = DEFAULT_RETENTION_SECONDS
    max_retention_seconds: float = DEFAULT_RETENTION_SECONDS
    router_url: str | None = None
    secret: str | None = None
    report_queue_size: int = 1024
    report_timeout_seconds: float = 2.0
    pull_timeout_seconds: float = 5.0
    dead_peer_seconds: float = 10.0
    peer_probe_seconds: float = 1.0
    nixl_progress_delay_us: int = 10_000
    demote_transfer_threads: bool = False
    idle_grace_seconds: float = 0.1
    idle_sleep_seconds: float = 0.005
    idle_max_wait_seconds: float = 30.0
    host_tier_bytes: int = 0
    sync_load_max_tokens: int = 512
    sync_load_timeout_seconds: float = 0.5

    def __post_init__(self) -> None:
        for name in (
            "default_retention_seconds",
            "max_retention_seconds",
            "idle_grace_seconds",
            "idle_sleep_seconds",
            "idle_max_wait_seconds",
            "nixl_progress_delay_us",
            "dead_peer_seconds",
            "peer_probe_seconds",
            "sync_load_max_tokens",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("report_timeout_seconds", "pull_timeout_seconds", "sync_load_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.report_queue_size < 1:
            raise ConfigError(f"report_queue_size must be >= 1, got {self.report_queue_size}")

    @property
    def report_url(self) -> str | None:
        """Where finished holdings are reported (docs/protocol.md section 5), if anywhere."""
        if not self.router_url:
            return None
        return self.router_url.rstrip("/") + wire.REPORT_PATH

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ
    ) -> ConnectorSettings:
        """Read ``kv_connector_extra_config``; the router URL and secret fall back to the env."""
        default_retention = float(extra.get("decoder_kv_blocks_ttl", DEFAULT_RETENTION_SECONDS))
        return cls(
            default_retention_seconds=default_retention,
            max_retention_seconds=float(
                extra.get(wire.EXTRA_MAX_RETENTION_SECONDS, default_retention)
            ),
            router_url=extra.get(wire.EXTRA_ROUTER_URL) or environ.get(wire.ROUTER_URL_ENV) or None,
            secret=extra.get(wire.EXTRA_SECRET) or environ.get(wire.SECRET_ENV) or None,
            report_queue_size=int(extra.get(wire.EXTRA_REPORT_QUEUE_SIZE, 1024)),
            report_timeout_seconds=float(extra.get(wire.EXTRA_REPORT_TIMEOUT_SECONDS, 2.0)),
            pull_timeout_seconds=float(extra.get(wire.EXTRA_PULL_TIMEOUT_SECONDS, 5.0)),
            dead_peer_seconds=float(extra.get(wire.EXTRA_DEAD_PEER_SECONDS, 10.0)),
            peer_probe_seconds=float(extra.get(wire.EXTRA_PEER_PROBE_MS, 1000.0)) / 1000,
            nixl_progress_delay_us=int(extra.get(wire.EXTRA_NIXL_PROGRESS_DELAY_US, 10_000)),
            demote_transfer_threads=bool(extra.get(wire.EXTRA_DEMOTE_TRANSFER_THREADS, False)),
            idle_grace_seconds=float(extra.get(wire.EXTRA_IDLE_GRACE_MS, 100.0)) / 1000,
            idle_sleep_seconds=float(extra.get(wire.EXTRA_IDLE_SLEEP_MS, 5.0)) / 1000,
            idle_max_wait_seconds=float(extra.get(wire.EXTRA_IDLE_MAX_WAIT_MS, 30_000.0)) / 1000,
            host_tier_bytes=int(extra.get(wire.EXTRA_HOST_TIER_BYTES, 0)),
            sync_load_max_tokens=int(extra.get(wire.EXTRA_SYNC_LOAD_MAX_TOKENS, 512)),
            sync_load_timeout_seconds=float(extra.get(wire.EXTRA_SYNC_LOAD_TIMEOUT_MS, 500.0))
            / 1000,
        )
