"""The decode engine's KV size, returned with every holding so that the router can keep
retained KV within a share of it (docs/router.md, "Capacity").

The connector reads it from vLLM's KV cache config, which the router cannot see: the tokens its
blocks hold (less the one block vLLM's block pool keeps as its null block) and what one token
occupies on one worker, summed over the cache groups' layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv_server import wire
from agentkv_server.connector.log import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["capacity_params"]

logger = get_logger(__name__)


def capacity_params(
    kv_cache_config: KVCacheConfig, block_size: int, host_tier_bytes: int = 0
) -> dict[str, Any]:
    """``agentkv_kv_cache_tokens`` and ``agentkv_kv_bytes_per_token``, and with a host tier of
    ``host_tier_bytes`` below the cache, ``agentkv_host_tier_tokens``; none when the config does
    not say (the router then budgets by its settings, or not at all)."""
    try:
        tokens = (int(kv_cache_config.num_blocks) - 1) * block_size  # one is the null block
        per_token = sum(
            group.kv_cache_spec.page_size_bytes
            * len(group.layer_names)
            / group.kv_cache_spec.block_size
            for group in kv_cache_config.kv_cache_groups
        )
    except (AttributeError, TypeError, ZeroDivisionError) as exc:
        logger.warning("KV capacity not reported to the router: %r", exc)
        return {}
    if tokens <= 0:
        return {}
    params: dict[str, Any] = {wire.KV_CACHE_TOKENS: tokens}
    if per_token > 0:
        params[wire.KV_BYTES_PER_TOKEN] = per_token
        if host_tier_bytes > 0:
            params[wire.HOST_TIER_TOKENS] = int(host_tier_bytes // per_token)
    return params
