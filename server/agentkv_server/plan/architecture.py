"""What a model configuration implies: parameters, KV bytes per token, FLOPs per prefill.

Counts follow the layer shapes in the configuration (norms and biases left out, well under
0.1% of the weights). Attention FLOPs are counted per (query, key) pair a causal prefill
touches; DeepSeek sparse attention caps the keys per query at ``index_topk`` but its indexer
still scores every pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv_server.plan.inputs import ModelConfig, Precision

__all__ = [
    "PrefillFlops",
    "active_params",
    "causal_pairs",
    "decode_kv_bytes_read",
    "expert_params",
    "expert_rows",
    "kv_bytes_per_token",
    "kv_bytes_per_token_per_rank",
    "kv_descriptors_per_rank",
    "prefill_flops",
    "total_params",
    "weight_bytes",
    "weight_bytes_read",
]

# vLLM's FP8 MLA cache (``fp8_ds_mla``, FlashMLA's sparse layout): the latent in FP8 with one
# float32 scale per 128 values, the rotary part kept in BF16.
_FP8_SCALE_GROUP = 128
_SCALE_BYTES = 4
_BYTES: dict[Precision, int] = {"bf16": 2, "fp8": 1}


def attention_params(c: ModelConfig) -> float:
    """Weights of one layer's attention block (MLA projections and indexer included)."""
    if not c.is_mla:
        q_and_o = 2 * c.hidden * c.q_heads * c.head_dim
        return q_and_o + 2 * c.hidden * c.kv_heads * c.head_dim
    qk_head = c.head_dim  # nope + rope
    q = c.hidden * c.q_lora_rank + c.q_lora_rank * c.q_heads * qk_head
    kv_down = c.hidden * (c.kv_lora_rank + c.qk_rope_head_dim)
    kv_up = c.kv_lora_rank * c.q_heads * (qk_head - c.qk_rope_head_dim + c.v_head_dim)
    out = c.q_heads * c.v_head_dim * c.hidden
    indexer = 0
    if c.index_topk:
        indexer = c.q_lora_rank * c.index_heads * c.index_head_dim
        indexer += c.hidden * c.index_head_dim + c.hidden * c.index_heads
    return q + kv_down + kv_up + out + indexer


def expert_params(c: ModelConfig) -> float:
    """Weights of one MoE expert (gate, up and down projections)."""
    return 3 * c.hidden * c.moe_intermediate


def _moe_layers(c: ModelConfig) -> int:
    return c.layers - c.mlp_dense_layers


def _embedding_params(c: ModelConfig) -> float:
    return c.vocab * c.hidden * (1 if c.tied_embeddings else 2)


def _always_active_params(c: ModelConfig) -> float:
    """Weights every token uses, embeddings left out: attention, dense MLPs, shared experts."""
    dense_mlp = c.mlp_dense_layers * 3 * c.hidden * c.intermediate
    moe_fixed = _moe_layers(c) * (c.shared_experts * expert_params(c) + c.hidden * c.routed_experts)
    return c.layers * attention_params(c) + dense_mlp + moe_fixed


def total_params(c: ModelConfig) -> float:
    routed = _moe_layers(c) * c.routed_experts * expert_params(c)
    return _always_active_params(c) + routed + _embedding_params(c)


def active_params(c: ModelConfig) -> float:
    """Parameters one token uses, embeddings included (the way model cards count them)."""
    routed = _moe_layers(c) * c.experts_per_token * expert_params(c)
    return _always_active_params(c) + routed + _embedding_params(c)


def weight_bytes(c: ModelConfig) -> float:
    """Bytes of all weights at the checkpoint's precision."""
    return total_params(c) * _BYTES[c.weight_precision]


def weight_bytes_read(c: ModelConfig, tokens: int, tensor_parallel: int) -> float:
    """Bytes of weights one GPU reads for a forward pass over ``tokens`` tokens.

    Routing is taken as uniform: a layer with E experts, k per token, touches
    ``E * (1 - (1 - k/E) ** tokens)`` of them, so a few hundred tokens touch nearly all.
    """
    params = _always_active_params(c) + _embedding_params(c) / 2  # lm_head; embedding is a lookup
    if c.is_moe:
        untouched = (1 - c.experts_per_token / c.routed_experts) ** tokens
        touched = c.routed_experts * (1 - untouched)
        params += _moe_layers(c) * touched * expert_params(c)
    return params * _BYTES[c.weight_precision] / tensor_parallel


def _latent_bytes(c: ModelConfig, precision: Precision) -> float:
    if precision == "bf16":
        return 2 * (c.kv_lora_rank + c.qk_rope_head_dim)
    scales = c.kv_lora_rank // _FP8_SCALE_GROUP * _SCALE_BYTES
    return c.kv_lora_rank + scales + 2 * c.qk_rope_head_dim


def _indexer_bytes(c: ModelConfig) -> float:
    """The indexer's key cache: FP8 keys with one float32 scale per token and layer."""
    return c.index_head_dim + _SCALE_BYTES if c.index_topk else 0


def kv_bytes_per_token(c: ModelConfig, precision: Precision) -> float:
    """KV cache bytes one token occupies across all layers (one copy of the whole cache)."""
    if c.is_mla:
        return c.layers * (_latent_bytes(c, precision) + _indexer_bytes(c))
    return c.layers * 2 * c.kv_heads * c.head_dim * _BYTES[precision]


def kv_bytes_per_token_per_rank(c: ModelConfig, precision: Precision, tp: int) -> float:
    """What one tensor-parallel rank stores per token (and sends in a KV transfer).

    GQA splits KV heads across ranks (replicating them when ranks outnumber heads); MLA's
    latent has no heads to split, so every rank holds all of it.
    """
    if c.is_mla:
        return kv_bytes_per_token(c, precision)
    heads_per_rank = max(c.kv_heads // tp, 1)
    return kv_bytes_per_token(c, precision) * heads_per_rank / c.kv_heads


def kv_descriptors_per_rank(c: ModelConfig, tokens: int, block_size: int) -> int:
    """Memory regions NIXL posts to move ``tokens`` tokens: per block, per layer, per tensor.

    vLLM stores a GQA layer's keys and values apart (two regions per block); an MLA layer has
    one latent region, plus one for the sparse-attention indexer's keys.
    """
    blocks = -(-tokens // block_size)
    tensors = (2 if c.index_topk else 1) if c.is_mla else 2
    return blocks * c.layers * tensors


def causal_pairs(new_tokens: int, context: int, cap: int = 0) -> float:
    """(query, key) pairs when ``new_tokens`` tokens attend causally after ``context`` tokens,
    each to at most ``cap`` keys when ``cap`` is set."""
    first, last = context + 1, context + new_tokens
    if not cap or last <= cap:
        return new_tokens * context + new_tokens * (new_tokens + 1) / 2
    if first > cap:
        return new_tokens * cap
    below = cap - context
    return causal_pairs(below, context) + (new_tokens - below) * cap


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of one prefill, split by the tensor-core precision each part runs at."""

    linear: float
    attention: float
    indexer: float


def expert_rows(c: ModelConfig, tokens: int, tile_rows: int) -> float:
    """Rows one MoE layer's grouped GEMM computes for ``tokens`` tokens, all experts together.

    Kernels that pad each expert's tokens to a whole tile (``tile_rows``) compute a full tile
    for an expert that got 3 tokens. With uniform routing an expert gets ``tokens * k / E`` on
    average; padding adds a tile per touched expert when that is under a tile, half a tile
    (the average remainder) when it is well over.
    """
    mean = tokens * c.experts_per_token / c.routed_experts
    if not tile_rows:
        return c.routed_experts * mean
    touched = 1 - (1 - c.experts_per_token / c.routed_experts) ** tokens
    return c.routed_experts * max(tile_rows * touched, mean + tile_rows / 2 * touched)


def prefill_flops(
    c: ModelConfig, new_tokens: int, context: int, expert_tile_rows: int = 0
) -> PrefillFlops:
    """FLOPs to prefill ``new_tokens`` tokens whose first ``context`` tokens' KV is at hand.

    Linear layers cost 2 FLOPs per active weight per token (the LM head once, for the last
    token; routed experts per :func:`expert_rows`). Attention costs 2 FLOPs per pair per
    query-key and per value element; MLA as vLLM runs it for sparse attention works in the
    latent space (keys of ``kv_lora_rank + rope``, values of ``kv_lora_rank``), its
    up-projections already among the linear weights.
    """
    linear = 2 * _always_active_params(c) * new_tokens
    if c.is_moe and new_tokens:
        rows = expert_rows(c, new_tokens, expert_tile_rows)
        linear += 2 * _moe_layers(c) * expert_params(c) * rows
    linear += 2 * c.vocab * c.hidden
    if c.is_mla:
        per_pair = 2 * c.q_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
    else:
        per_pair = 2 * c.q_heads * (c.head_dim + c.v_head_dim)
    attention = c.layers * per_pair * causal_pairs(new_tokens, context, c.index_topk)
    indexer = 0.0
    if c.index_topk:
        indexer = (
            c.layers * 2 * c.index_heads * c.index_head_dim * causal_pairs(new_tokens, context)
        )
    return PrefillFlops(linear=linear, attention=attention, indexer=indexer)


def decode_kv_bytes_read(c: ModelConfig, precision: Precision, context: int, tp: int) -> float:
    """KV bytes one rank reads to decode one token after ``context`` tokens.

    Sparse attention reads the indexer's keys for every token but the latent only for the
    ``index_topk`` tokens it selects.
    """
    if c.index_topk:
        latent = _latent_bytes(c, precision) * min(context, c.index_topk)
        return c.layers * (latent + _indexer_bytes(c) * context)
    return kv_bytes_per_token_per_rank(c, precision, tp) * context
