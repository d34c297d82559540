"""Worker half of ``AgentKVConnector``: NixlConnector's pull worker, made safe on CPU engines.

Four changes to upstream:

* **Thread affinity.** On the CPU platform ``NixlBaseConnectorWorker.__init__`` calls
  ``os.sched_setaffinity(0, last_core_of_each_numa_node)`` to keep KV transfers off the cores
  that run the model. ``pid 0`` means the *calling thread*, which is the worker's main thread:
  the one that runs every forward pass. Its ``VLLM_CPU_OMP_THREADS_BIND`` core is overridden,
  so on a small machine every engine's forward thread lands on the same last core, next to
  the other engines' spinning threads, and a prefill engine can starve for minutes (the
  "stall" in DESIGN.md section 5). We restore the thread's own affinity after upstream's
  constructor; threads NIXL started meanwhile keep the reserved core, as upstream intends.
* **Progress thread paced.** NIXL's progress thread polls without pause, a core per engine
  even when nothing moves; the agent is built with a poll timeout (``progress.py``), so the
  thread sleeps until UCX has an event, or ``nixl_progress_delay_us`` passes.
* **Polling threads demoted.** The native threads upstream's constructor starts are moved to
  ``SCHED_IDLE`` (``demote_transfer_threads``), so they use only cores that forward passes
  leave idle.
* **Pull deadline.** A read that is still in flight after ``pull_timeout_seconds`` is aborted
  and reported as a failed load, which the scheduler turns into a recompute
  (``kv_load_failure_policy="recompute"``), so no request waits forever on a peer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

from agentkv_server.connector.affinity import (
    demote_to_idle_priority,
    native_threads_started,
    preserved_thread_affinity,
)
from agentkv_server.connector.deadlines import Deadlines
from agentkv_server.connector.log import get_logger
from agentkv_server.connector.progress import nixl_progress_delay
from agentkv_server.connector.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["AgentKVWorker"]

logger = get_logger(__name__)


class AgentKVWorker(NixlPullConnectorWorker):
    """NixlConnector's pull worker that keeps its thread's cores, paces NIXL's polling thread,
    and bounds every pull."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
    ) -> None:
        with (
            preserved_thread_affinity(),
            native_threads_started() as started,
            nixl_progress_delay(settings.nixl_progress_delay_us),
        ):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        if settings.demote_transfer_threads:
            demoted = demote_to_idle_priority(started)
            logger.info("Demoted %d NIXL thread(s) to SCHED_IDLE: %s", len(demoted), demoted)
        self._pull_deadlines = Deadlines()
        self._pull_timeout = settings.pull_timeout_seconds

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        deadline = time.monotonic() + self._pull_timeout
        for req_id in metadata.reqs_to_recv:
            self._pull_deadlines.set(req_id, deadline)
        super().start_load_kv(metadata)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._abort_overdue_pulls()
        results = super().get_transfer_results()
        for req_id in results.finished_recving:
            self._pull_deadlines.discard(req_id)
        return results

    def _abort_overdue_pulls(self) -> None:
        """Fail reads that outlived their deadline so their requests recompute.

        Only requests with posted reads are aborted: a pull still in its handshake is bounded
        by upstream's handshake timeout, and failing it here would let the handshake's late
        completion post reads into blocks the request no longer owns.
        """
        for req_id in self._pull_deadlines.pop_overdue(time.monotonic()):
            handles = self._recving_transfers.get(req_id)
            if req_id not in self._recving_metadata or handles is None:
                continue
            logger.warning(
                "KV pull for request %s still in flight after %.0f s: aborting it, "
                "the request recomputes its prefix instead.",
                req_id,
                self._pull_timeout,
            )
            # Upstream releases (aborts) each handle and keeps the ones the backend could
            # not release, with their blocks, until the transfer really stops.
            kept = [
                handle
                for handle in handles
                if not self._handle_failed_transfer(req_id, handle, self._recv_failures)
            ]
            self._recv_failures.add(req_id)
            if kept:
                self._recving_transfers[req_id] = kept
            else:
                del self._recving_transfers[req_id]
