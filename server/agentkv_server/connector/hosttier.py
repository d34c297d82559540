"""A host-memory tier below a CPU engine's KV cache, for vLLM's ``OffloadingConnector``.

vLLM's own CPU offloading spec copies between device tensors and pinned host buffers on
device streams, so it refuses to start on the CPU backend. On a CPU engine the KV cache is
itself host memory, but a bounded pool (``VLLM_CPU_KVCACHE_SPACE``) that live requests and
retained holdings share; this spec gives the engine a second, larger pool beside it, so a
holding the router releases for room leaves a copy that a later turn loads back with a
memory copy instead of recomputing its history (docs/connector.md, "A tier below").

Only the worker is ours: the scheduler side (which blocks to store, LRU eviction, lookups by
block hash) is vLLM's ``CPUOffloadingManager``, reached through ``CPUOffloadingSpec``.
"""

from __future__ import annotations

import time

import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from agentkv_server.connector.log import get_logger

__all__ = ["HostTierSpec", "HostTierWorker"]

logger = get_logger(__name__)


class HostTierSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` whose worker copies between CPU tensors (``HostTierWorker``).

    Load it through ``OffloadingConnector`` with ``"spec_name": "HostTierSpec"``,
    ``"spec_module_path": "agentkv_server.connector.hosttier"`` and ``cpu_bytes_to_use``.
    """

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostTierWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


class HostTierWorker(OffloadingWorker):
    """Copies whole blocks between the engine's KV cache and a host pool, synchronously.

    On a CPU engine a store or load is a memory copy on the engine's own cores, so there is
    no stream to overlap it with: each job runs when submitted (stores at the start of the
    step after the one that computed their KV, as ``OffloadingConnector`` submits them) and
    is reported finished at the next poll.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        if blocks_per_chunk != 1:
            raise ValueError(
                "the host tier stores one engine block per chunk: leave the offloading "
                f"connector's block_size at the engine's (got {blocks_per_chunk} per chunk)"
            )
        self._engine = [cache.tensor for cache in kv_caches.tensors]
        self._host = [
            torch.zeros((num_chunks, cache.tensor.shape[1]), dtype=torch.int8)
            for cache in kv_caches.tensors
        ]
        self._bytes_per_block = sum(cache.tensor.shape[1] for cache in kv_caches.tensors)
        self._finished: list[TransferResult] = []
        logger.info(
            "host tier: %d blocks of %d bytes (%.2f GiB)",
            num_chunks,
            self._bytes_per_block,
            num_chunks * self._bytes_per_block / 2**30,
        )

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._copy(job_id, self._engine, src_spec, self._host, dst_spec)
        return True

    @override
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self._copy(job_id, self._host, src_spec, self._engine, dst_spec)
        return True

    @override
    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    @override
    def wait(self, job_ids: set[int]) -> None:
        """Every job is done once submitted."""

    def _copy(
        self,
        job_id: int,
        sources: list[torch.Tensor],
        source_spec: LoadStoreSpec,
        targets: list[torch.Tensor],
        target_spec: LoadStoreSpec,
    ) -> None:
        started = time.perf_counter()
        source_ids = torch.as_tensor(source_spec.block_ids, dtype=torch.long)
        target_ids = torch.as_tensor(target_spec.block_ids, dtype=torch.long)
        if len(source_ids) != len(target_ids):
            raise ValueError(f"job {job_id}: {len(source_ids)} blocks to {len(target_ids)}")
        for source, target in zip(sources, targets, strict=True):
            target.index_copy_(0, target_ids, source.index_select(0, source_ids))
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=len(source_ids) * self._bytes_per_block,
                transfer_time=time.perf_counter() - started,
            )
        )
