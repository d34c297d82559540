"""The vocabulary of the cluster model's inputs: hardware, links, model configurations, serving.

Every figure carries where it comes from (:class:`Source`): a published specification, a
published measurement, or an assumption named as one. The figures themselves live in
:mod:`agentkv_server.plan.catalog`; this module only says what an input is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "AssumedEfficiency",
    "GpuSpec",
    "LinkSpec",
    "MeasuredPrefill",
    "ModelConfig",
    "NodeSpec",
    "SeedCase",
    "ServingSpec",
    "Slo",
    "Source",
    "Workload",
]

Precision = Literal["bf16", "fp8"]


@dataclass(frozen=True)
class Source:
    """Where a figure comes from. ``kind`` says how far to trust it."""

    kind: Literal["specification", "configuration", "measurement", "assumption"]
    reference: str
    """A URL, or for an assumption the reason it is reasonable."""


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: memory, memory bandwidth and dense (not sparse) tensor throughput."""

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    dense_flops: dict[Precision, float]
    source: Source


@dataclass(frozen=True)
class NodeSpec:
    """One machine: how many GPUs and how much network bandwidth leaves it."""

    name: str
    gpus: int
    network_bits_per_s: float
    source: Source

    @property
    def network_bytes_per_s_per_gpu(self) -> float:
        return self.network_bits_per_s / 8 / self.gpus


@dataclass(frozen=True)
class LinkSpec:
    """How a KV load between two engines behaves on top of the wire (NIXL, RDMA).

    A load of KV from another engine costs ``handover_s`` (scheduling the read, waiting for
    engine-step boundaries, the completion notice), the bytes at ``efficiency`` of the line
    rate, and ``per_descriptor_s`` for each memory region NIXL posts (one per KV block per
    layer, per key and value where they are stored apart).
    """

    efficiency: float
    per_descriptor_s: float
    handover_s: float
    http_hop_s: float
    sources: dict[str, Source]


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Hugging Face ``config.json`` that set compute, weights and KV size.

    Dense GQA models leave the MLA, sparse-attention and MoE fields at zero. ``kv_lora_rank``
    set means multi-head latent attention (one latent vector per token and layer, the same on
    every tensor-parallel rank); ``index_topk`` set means DeepSeek sparse attention (each query
    attends to at most that many keys, chosen by an indexer that scores every key).
    """

    name: str
    layers: int
    hidden: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate: int
    weight_precision: Precision
    tied_embeddings: bool
    source: Source
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    dense_layers: int | None = None
    """Layers with a dense MLP (``first_k_dense_replace``); None: all of them."""
    moe_intermediate: int = 0
    routed_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    published_params: tuple[float, float] | None = None
    """(total, active) parameters as the model card states them: a check on the arithmetic."""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.routed_experts > 0

    @property
    def mlp_dense_layers(self) -> int:
        return self.layers if self.dense_layers is None else self.dense_layers


@dataclass(frozen=True)
class AssumedEfficiency:
    """Prefill model-FLOPs utilisation taken as an assumption, named as such."""

    mfu: float
    source: Source


@dataclass(frozen=True)
class MeasuredPrefill:
    """A published prefill measurement (one prompt, nothing else running) to derive MFU from."""

    prompt_tokens: int
    ttft_s: float
    source: Source


@dataclass(frozen=True)
class ServingSpec:
    """How one model is served: engine width, KV layout and prefill efficiency."""

    model: ModelConfig
    tensor_parallel: int
    kv_cache_precision: Precision
    block_size: int
    gpu_memory_utilization: float
    prefill_efficiency: AssumedEfficiency | MeasuredPrefill
    sources: dict[str, Source]
    expert_tile_rows: int = 0
    """Rows the MoE kernel pads each expert's tokens to (0: no MoE, or no padding)."""


@dataclass(frozen=True)
class Workload:
    """One follow-up turn: the history held from the last turn plus fresh tokens."""

    new_tokens: int
    output_tokens: int
    source: Source


@dataclass(frozen=True)
class Slo:
    """What the deployment promises the sessions decoding on D: the holder path may prefill on
    D only if the other sessions' decoding stalls no longer than ``itl_budget_s``."""

    itl_budget_s: float
    source: Source


@dataclass(frozen=True)
class SeedCase:
    """A published before/after measurement the model must reproduce as a ratio."""

    serving: ServingSpec
    history_tokens: int
    recompute_ttft_s: float
    pull_ttft_s: float
    source: Source
    label: str = field(default="")

    @property
    def published_ratio(self) -> float:
        return self.recompute_ttft_s / self.pull_ttft_s
