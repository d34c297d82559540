"""``AgentKVConnector``: the facade vLLM instantiates, once per role.

Like upstream's ``NixlPullConnector`` it builds a scheduler half or a worker half; it builds
agentkv's halves instead of upstream's, and otherwise forwards exactly as upstream does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from agentkv_server.connector.log import get_logger
from agentkv_server.connector.scheduler import AgentKVScheduler
from agentkv_server.connector.settings import ConnectorSettings
from agentkv_server.connector.worker import AgentKVWorker

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["AgentKVConnector"]

logger = get_logger(__name__)


class AgentKVConnector(NixlConnector):
    """NixlConnector (pull mode) with request-driven retention, release, prefix verification,
    holding reports to the router, bounded pulls, and the CPU affinity fix.

    Load it with ``--kv-transfer-config '{"kv_connector": "AgentKVConnector",
    "kv_connector_module_path": "agentkv_server.connector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": true, ...}}'`` (docs/connector.md).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        # Skip NixlPullConnector.__init__, whose only work is to build upstream's halves:
        # building those and then replacing them would start a second NIXL agent.
        super(NixlConnector, self).__init__(vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        if role == KVConnectorRole.SCHEDULER:
            _prefer_recompute(vllm_config.kv_transfer_config)
            self.connector_scheduler = AgentKVScheduler(
                vllm_config, self.engine_id, kv_cache_config, settings
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = AgentKVWorker(
                vllm_config, self.engine_id, kv_cache_config, settings
            )

    def has_pending_block_frees(self) -> bool:
        """Released or expired holdings about to be freed: a request short of blocks waits for
        them rather than preempting another (scheduler.py)."""
        scheduler = self.connector_scheduler
        return isinstance(scheduler, AgentKVScheduler) and scheduler.has_pending_block_frees()


def _prefer_recompute(config: KVTransferConfig) -> None:
    """Turn failed KV loads into recomputes: reuse is an optimisation, never a dependency.

    vLLM's default policy fails the request. The scheduler reads the policy right after it
    builds its connector, so setting it here takes effect.
    """
    if config.kv_load_failure_policy != "recompute":
        logger.info("AgentKVConnector: kv_load_failure_policy set to 'recompute'")
        config.kv_load_failure_policy = "recompute"
