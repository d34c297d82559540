"""The host tier's worker: whole blocks copied between an engine's KV cache and host memory
and back, byte for byte (connector/hosttier.py). The real engine's use of it is
tests/engine/test_host_tier.py."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from agentkv_server.connector.hosttier import HostTierWorker

BLOCKS, PAGE = 8, 64


def caches() -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """Two layers' caches of BLOCKS blocks, each block's bytes set to its own pattern."""
    tensors = [
        torch.arange(BLOCKS * PAGE, dtype=torch.int32).to(torch.int8).view(BLOCKS, PAGE) + layer
        for layer in range(2)
    ]
    refs = [[CanonicalKVCacheRef(index, PAGE) for index in range(2)]]
    return tensors, CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors], refs)


def engine_blocks(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])


def test_blocks_stored_then_loaded_elsewhere_come_back_identical():
    tensors, kv_caches = caches()
    original = [t.clone() for t in tensors]
    worker = HostTierWorker(kv_caches, blocks_per_chunk=1, num_chunks=4)

    assert worker.submit_store(1, engine_blocks([5, 2]), CPULoadStoreSpec([0, 3]))
    for t in tensors:
        t.zero_()  # the engine reuses those blocks
    assert worker.submit_load(2, CPULoadStoreSpec([3, 0]), engine_blocks([6, 7]))

    finished = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in finished] == [
        (1, True, 2 * 2 * PAGE),
        (2, True, 2 * 2 * PAGE),
    ]
    assert worker.get_finished() == []  # each job reported once
    for layer, t in enumerate(tensors):
        assert torch.equal(t[6], original[layer][2]) and torch.equal(t[7], original[layer][5])


def test_a_chunk_of_several_blocks_is_refused_with_a_reason():
    _, kv_caches = caches()
    with pytest.raises(ValueError, match="one engine block per chunk"):
        HostTierWorker(kv_caches, blocks_per_chunk=2, num_chunks=4)
