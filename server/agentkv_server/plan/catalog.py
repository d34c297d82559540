"""The published figures the cluster model starts from, each with its source.

Nothing here is fitted to the seed's two ratios: hardware from datasheets, models from their
``config.json``, the KV link from published NIXL/EFA measurements, and what is not published
named as an assumption. docs/cluster-model.md explains each figure.
"""

from __future__ import annotations

from agentkv_server.plan.inputs import (
    AssumedEfficiency,
    GpuSpec,
    LinkSpec,
    MeasuredPrefill,
    ModelConfig,
    NodeSpec,
    SeedCase,
    ServingSpec,
    Slo,
    Source,
    Workload,
)

__all__ = [
    "GLM_5_FP8",
    "H200",
    "ITL_SLO",
    "NIXL_OVER_EFA",
    "P5EN",
    "QWEN3_32B",
    "SEED_CASES",
    "SEED_WORKLOAD",
    "SERVINGS",
]

H200 = GpuSpec(
    name="NVIDIA H200 SXM",
    hbm_bytes=141e9,
    hbm_bytes_per_s=4.8e12,
    # The datasheet's 1,979 (BF16) and 3,958 (FP8) TFLOPS are with 2:4 sparsity; dense is half.
    dense_flops={"bf16": 989.5e12, "fp8": 1979e12},
    source=Source("specification", "https://www.nvidia.com/en-us/data-center/h200/"),
)

P5EN = NodeSpec(
    name="AWS p5en.48xlarge",
    gpus=8,
    network_bits_per_s=3200e9,  # EFAv3, 16 x 200 Gbps
    source=Source("specification", "https://aws.amazon.com/ec2/instance-types/p5/"),
)

NIXL_OVER_EFA = LinkSpec(
    efficiency=284.98 / 400,
    per_descriptor_s=1024 / 0.715e9,
    handover_s=0.197 - 0.029 - 0.058,
    http_hop_s=0.002,
    sources={
        "efficiency": Source(
            "measurement",
            "https://github.com/ai-dynamo/nixl/issues/1021 (UCX put bandwidth over EFA between "
            "two p5 nodes: 284.98 GB/s of the 400 GB/s line rate)",
        ),
        "per_descriptor_s": Source(
            "measurement",
            "https://github.com/LMCache/LMCache/pull/4161 (NIXL over UCX, 256 descriptors of "
            "1 KiB per transfer: 0.715 GB/s, i.e. 1.43 us per descriptor)",
        ),
        "handover_s": Source(
            "measurement",
            "https://github.com/vllm-project/vllm/pull/51919 (NIXL KV handover 197 ms p50, of "
            "which 29 ms moving bytes and 58 ms recomputing the first token: 110 ms scheduling, "
            "engine-step alignment and completion notice)",
        ),
        "http_hop_s": Source(
            "assumption",
            "one HTTP request router -> engine inside one placement group: under a millisecond "
            "of network, the rest request parsing; 2 ms",
        ),
    },
)

QWEN3_32B = ModelConfig(
    name="Qwen3-32B",
    layers=64,
    hidden=5120,
    vocab=151936,
    q_heads=64,
    kv_heads=8,
    head_dim=128,
    v_head_dim=128,
    intermediate=25600,
    weight_precision="bf16",
    tied_embeddings=False,
    published_params=(32.8e9, 32.8e9),
    source=Source("configuration", "https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json"),
)

GLM_5_FP8 = ModelConfig(
    name="GLM-5-FP8",
    layers=78,
    hidden=6144,
    vocab=154880,
    q_heads=64,
    kv_heads=64,
    head_dim=256,  # qk_head_dim: 192 without rotary + 64 rotary
    v_head_dim=256,
    intermediate=12288,
    weight_precision="fp8",
    tied_embeddings=False,
    kv_lora_rank=512,
    q_lora_rank=2048,
    qk_rope_head_dim=64,
    index_topk=2048,
    index_heads=32,
    index_head_dim=128,
    dense_layers=3,
    moe_intermediate=2048,
    routed_experts=256,
    experts_per_token=8,
    shared_experts=1,
    published_params=(744e9, 40e9),
    source=Source(
        "configuration", "https://huggingface.co/zai-org/GLM-5-FP8/blob/main/config.json"
    ),
)

_ONE_NODE_PER_ENGINE = Source(
    "assumption",
    "the seed runs 1P1D on H200 nodes: one p5en node (8 GPUs) per engine, tensor parallel 8",
)
_VLLM_DEFAULTS = Source(
    "specification", "vLLM engine defaults (--gpu-memory-utilization 0.9, --block-size 16)"
)

SERVINGS: dict[str, ServingSpec] = {
    "qwen3-32b": ServingSpec(
        model=QWEN3_32B,
        tensor_parallel=8,
        kv_cache_precision="bf16",
        block_size=16,
        gpu_memory_utilization=0.9,
        prefill_efficiency=AssumedEfficiency(
            mfu=0.40,
            source=Source(
                "assumption",
                "a dense BF16 prefill of thousands of tokens keeps tensor cores busy; 40% of "
                "the dense peak after tensor-parallel all-reduces and attention",
            ),
        ),
        sources={
            "tensor_parallel": _ONE_NODE_PER_ENGINE,
            "kv_cache_precision": Source("specification", "vLLM --kv-cache-dtype auto (BF16)"),
            "block_size": _VLLM_DEFAULTS,
            "gpu_memory_utilization": _VLLM_DEFAULTS,
        },
    ),
    "glm-5-fp8": ServingSpec(
        model=GLM_5_FP8,
        tensor_parallel=8,
        kv_cache_precision="bf16",
        block_size=64,
        gpu_memory_utilization=0.9,
        prefill_efficiency=MeasuredPrefill(
            prompt_tokens=8192,
            ttft_s=0.670,
            source=Source(
                "measurement",
                "https://github.com/sgl-project/sglang/pull/31554 (GLM-5.2-FP8, same "
                "architecture, 8 x H200: 8,192-token prompt alone, mean TTFT 670 ms)",
            ),
        ),
        sources={
            "tensor_parallel": _ONE_NODE_PER_ENGINE,
            "kv_cache_precision": Source(
                "specification",
                "vLLM --kv-cache-dtype auto: BF16 for GLM-5-FP8; an FP8 default for GLM FP8 "
                "checkpoints came only with https://github.com/vllm-project/vllm/pull/53138, "
                "after the seed (later GLM-5.x recipes pass --kv-cache-dtype fp8 on Hopper: "
                "https://github.com/vllm-project/recipes/pull/754)",
            ),
            "block_size": Source(
                "specification", "FlashMLA's sparse kernels page the latent cache by 64 tokens"
            ),
            "gpu_memory_utilization": _VLLM_DEFAULTS,
            "expert_tile_rows": Source(
                "specification",
                "https://github.com/deepseek-ai/DeepGEMM (FP8 grouped GEMM for MoE, contiguous "
                "layout: each expert's rows aligned to the 128-row M block)",
            ),
        },
        expert_tile_rows=128,
    ),
}

SEED_WORKLOAD = Workload(
    new_tokens=140,
    output_tokens=1000,
    source=Source(
        "measurement",
        "https://github.com/vllm-project/vllm/pull/32553 (AWS's multi-turn benchmark of "
        "bidirectional KV transfer on p5en: 120-160 new input tokens and 800-1,200 output "
        "tokens per turn)",
    ),
)

ITL_SLO = Slo(
    itl_budget_s=0.025,
    source=Source(
        "specification",
        "https://docs.nvidia.com/dynamo/dev/benchmarks/qwen3-32b-kv-routing (goodput of "
        "disaggregated Qwen3-32B on H200 counted at TTFT 2 s and ITL 25 ms)",
    ),
)

_SEED_SOURCE = Source(
    "measurement",
    "AWS, vLLM bidirectional KV transfer on 1P1D H200 nodes over EFA, follow-up TTFT "
    "recomputed vs pulled, as agentkv issue 15 quotes it (the feature: "
    "https://github.com/vllm-project/vllm/pull/32553)",
)

SEED_CASES: tuple[SeedCase, ...] = (
    SeedCase(
        serving=SERVINGS["qwen3-32b"],
        history_tokens=24_000,
        recompute_ttft_s=0.778,
        pull_ttft_s=0.460,
        source=_SEED_SOURCE,
        label="Qwen3-32B at a 24k prefix",
    ),
    SeedCase(
        serving=SERVINGS["glm-5-fp8"],
        history_tokens=20_000,
        recompute_ttft_s=2.334,
        pull_ttft_s=0.702,
        source=_SEED_SOURCE,
        label="GLM-5-FP8 at a 20k prefix",
    ),
)
