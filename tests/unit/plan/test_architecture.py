"""Parameters, KV bytes and FLOPs derived from the model configurations."""

from __future__ import annotations

import pytest

from agentkv_server.plan import architecture as arch
from agentkv_server.plan.catalog import GLM_5_FP8, QWEN3_32B

MODELS = [QWEN3_32B, GLM_5_FP8]


@pytest.mark.parametrize("config", MODELS, ids=lambda c: c.name)
def test_parameter_counts_from_the_config_match_the_model_card(config) -> None:
    total, active = config.published_params
    assert arch.total_params(config) == pytest.approx(total, rel=0.01)
    assert arch.active_params(config) == pytest.approx(active, rel=0.05)


def test_gqa_kv_splits_across_ranks_but_mla_latent_is_replicated() -> None:
    qwen = arch.kv_bytes_per_token(QWEN3_32B, "bf16")
    assert arch.kv_bytes_per_token_per_rank(QWEN3_32B, "bf16", 8) == qwen / 8
    assert arch.kv_bytes_per_token_per_rank(QWEN3_32B, "bf16", 16) == qwen / 8  # 8 KV heads
    glm = arch.kv_bytes_per_token(GLM_5_FP8, "fp8")
    assert arch.kv_bytes_per_token_per_rank(GLM_5_FP8, "fp8", 8) == glm


def test_latent_attention_needs_far_less_kv_per_token_than_grouped_query_attention() -> None:
    qwen = arch.kv_bytes_per_token(QWEN3_32B, "bf16") / QWEN3_32B.layers
    glm = arch.kv_bytes_per_token(GLM_5_FP8, "bf16") / GLM_5_FP8.layers
    assert glm < qwen / 3
    assert arch.kv_bytes_per_token(GLM_5_FP8, "fp8") < arch.kv_bytes_per_token(GLM_5_FP8, "bf16")


def test_sparse_attention_caps_pairs_per_query_but_not_the_indexer() -> None:
    cap = GLM_5_FP8.index_topk
    assert arch.causal_pairs(100, 10 * cap, cap) == 100 * cap
    assert arch.causal_pairs(100, 10 * cap) > 100 * 10 * cap
    assert arch.causal_pairs(cap, 0, cap) == arch.causal_pairs(cap, 0)
    long, short = (arch.prefill_flops(GLM_5_FP8, 100, c) for c in (20 * cap, 10 * cap))
    assert long.attention == short.attention
    assert long.indexer > 1.9 * short.indexer


def test_few_tokens_touch_every_expert_and_pay_a_whole_tile_each() -> None:
    few = arch.expert_rows(GLM_5_FP8, 140, 128)
    assert few == pytest.approx(GLM_5_FP8.routed_experts * 128, rel=0.02)
    assert arch.expert_rows(GLM_5_FP8, 140, 0) == 140 * GLM_5_FP8.experts_per_token
    many = arch.expert_rows(GLM_5_FP8, 100_000, 128)
    assert many == pytest.approx(100_000 * GLM_5_FP8.experts_per_token, rel=0.05)


def test_a_single_token_reads_only_the_experts_it_routes_to() -> None:
    one = arch.weight_bytes_read(GLM_5_FP8, 1, 8)
    many = arch.weight_bytes_read(GLM_5_FP8, 4096, 8)
    assert many == pytest.approx(arch.total_params(GLM_5_FP8) / 8, rel=0.02)
    assert one < many / 10


def test_descriptors_count_blocks_layers_and_tensors() -> None:
    assert arch.kv_descriptors_per_rank(QWEN3_32B, 16, 16) == QWEN3_32B.layers * 2
    assert arch.kv_descriptors_per_rank(QWEN3_32B, 17, 16) == QWEN3_32B.layers * 4
    assert arch.kv_descriptors_per_rank(GLM_5_FP8, 64, 64) == GLM_5_FP8.layers * 2
