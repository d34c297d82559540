"""The cluster model: predicted follow-up TTFT per path on a prefill/decode pair of GPU nodes.

A follow-up turn holds ``history`` tokens of KV on the decode engine D (from the last turn) and
brings ``new`` fresh tokens. Three ways to its first token:

* **recompute**: the prefill engine P computes all of it, D loads the new part from P (D's
  own prefix cache still holds the history) and decodes;
* **pull**: P loads the history from D over the network, computes the new part, D loads
  that and decodes;
* **holder** (continue on the holder): D prefills the new tokens itself on top of its cache,
  inside the batch of the other sessions it is decoding, stalling them for that long.

agentkv's policy picks the fastest open path per turn, the holder path only while its stall
stays within the deployment's ITL budget (:class:`~agentkv_server.plan.inputs.Slo`).

Compute-bound steps run at ``mfu`` of the GPUs' dense peak; memory-bound ones at HBM
bandwidth; each step takes the longer of the two. KV loads cost what
:class:`~agentkv_server.plan.inputs.LinkSpec` says. The other sessions D holds are taken as
decoding (the loaded case). Nothing queues on P. This is a model, not a measurement.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from agentkv_server.plan import architecture as arch
from agentkv_server.plan.catalog import H200, ITL_SLO, NIXL_OVER_EFA, P5EN, SEED_WORKLOAD
from agentkv_server.plan.inputs import (
    AssumedEfficiency,
    GpuSpec,
    LinkSpec,
    NodeSpec,
    SeedCase,
    ServingSpec,
    Slo,
    Workload,
)

__all__ = [
    "PATHS",
    "ClusterModel",
    "FollowUp",
    "PathName",
    "SeedCheck",
    "check_seed",
]

PathName = Literal["recompute", "pull", "holder"]
PATHS: tuple[PathName, ...] = ("recompute", "pull", "holder")


@dataclass(frozen=True)
class FollowUp:
    """Predicted TTFT of one follow-up turn per path; None where the path is not open
    (more sessions than D can hold: their KV is evicted, only recompute is left)."""

    history_tokens: int
    sessions: int
    session_limit: int
    seconds: dict[PathName, float | None]
    holder_stall_s: float | None
    """How long the holder path's prefill holds up the other sessions' decoding on D."""
    holder_allowed: bool
    """Whether that stall fits the ITL budget (always, with no other session to stall)."""

    @property
    def best(self) -> PathName:
        """agentkv's per-turn pick: the fastest open path the ITL budget allows."""
        allowed = {
            p: s
            for p, s in self.seconds.items()
            if s is not None and (p != "holder" or self.holder_allowed)
        }
        return min(allowed, key=allowed.__getitem__)

    def margins(self) -> dict[PathName, float | None]:
        """Each fixed path's TTFT over the policy's (below 1: faster, but over the budget)."""
        best = self.seconds[self.best]
        assert best is not None
        return {p: None if s is None else s / best for p, s in self.seconds.items()}


class ClusterModel:
    """Predicts follow-up TTFT for one model served 1P1D on two GPU nodes."""

    def __init__(
        self,
        serving: ServingSpec,
        *,
        gpu: GpuSpec = H200,
        node: NodeSpec = P5EN,
        link: LinkSpec = NIXL_OVER_EFA,
        workload: Workload = SEED_WORKLOAD,
        slo: Slo = ITL_SLO,
    ) -> None:
        self.serving = serving
        self.gpu = gpu
        self.node = node
        self.link = link
        self.workload = workload
        self.slo = slo
        self.mfu = self._prefill_mfu()

    @property
    def _tp(self) -> int:
        return self.serving.tensor_parallel

    # compute -------------------------------------------------------------------------------

    def _compute_s(self, flops: arch.PrefillFlops, mfu: float) -> float:
        model = self.serving.model
        peak = self.gpu.dense_flops
        per_gpu = (
            flops.linear / peak[model.weight_precision]
            + flops.attention / peak["bf16"]
            + flops.indexer / peak["fp8"]
        )
        return per_gpu / (self._tp * mfu)

    def _flops(self, new_tokens: int, context: int) -> arch.PrefillFlops:
        serving = self.serving
        return arch.prefill_flops(serving.model, new_tokens, context, serving.expert_tile_rows)

    def _prefill_mfu(self) -> float:
        efficiency = self.serving.prefill_efficiency
        if isinstance(efficiency, AssumedEfficiency):
            return efficiency.mfu
        flops = self._flops(efficiency.prompt_tokens, 0)
        return self._compute_s(flops, 1.0) / efficiency.ttft_s

    def _weights_s(self, tokens: int) -> float:
        model = self.serving.model
        return arch.weight_bytes_read(model, tokens, self._tp) / self.gpu.hbm_bytes_per_s

    def _decoders_kv_s(self, decoders: int, context: int) -> float:
        serving = self.serving
        per_token = arch.decode_kv_bytes_read(
            serving.model, serving.kv_cache_precision, context, self._tp
        )
        return decoders * per_token / self.gpu.hbm_bytes_per_s

    def step_s(self, new_tokens: int, context: int, decoders: int = 0) -> float:
        """One engine step: prefill ``new_tokens`` after ``context`` cached tokens, alongside
        ``decoders`` sessions each decoding one token after ``context`` tokens."""
        flops = self._flops(new_tokens, context)
        compute = self._compute_s(flops, self.mfu) if new_tokens else 0.0
        weights = self._weights_s(new_tokens + decoders)
        return max(compute, weights) + self._decoders_kv_s(decoders, context)

    def prefill_s(self, new_tokens: int, context: int) -> float:
        return self.step_s(new_tokens, context)

    # network -------------------------------------------------------------------------------

    def kv_load_s(self, tokens: int) -> float:
        """An engine loading ``tokens`` tokens of KV from the other engine (ranks in parallel)."""
        serving = self.serving
        model = serving.model
        per_rank = tokens * arch.kv_bytes_per_token_per_rank(
            model, serving.kv_cache_precision, self._tp
        )
        wire = per_rank / (self.node.network_bytes_per_s_per_gpu * self.link.efficiency)
        descriptors = arch.kv_descriptors_per_rank(model, tokens, serving.block_size)
        return self.link.handover_s + wire + descriptors * self.link.per_descriptor_s

    # memory --------------------------------------------------------------------------------

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV one decode engine can hold: HBM left after the weights."""
        serving = self.serving
        model = serving.model
        weights_per_gpu = arch.weight_bytes(model) / self._tp
        free = self.gpu.hbm_bytes * serving.gpu_memory_utilization - weights_per_gpu
        per_token = arch.kv_bytes_per_token_per_rank(model, serving.kv_cache_precision, self._tp)
        return max(int(free // per_token), 0)

    def session_limit(self, history_tokens: int) -> int:
        """Sessions D can hold at this history, each with its next turn's tokens too."""
        per_session = history_tokens + self.workload.new_tokens + self.workload.output_tokens
        return self.kv_capacity_tokens() // per_session

    # paths ---------------------------------------------------------------------------------

    def _decode_first_token_s(self, others: int, context: int) -> float:
        """D's first token once the KV is in place: wait out the running step, then one step."""
        wait = self.step_s(0, context, others) / 2 if others else 0.0
        return wait + self.step_s(0, context, others + 1)

    def recompute_s(self, history: int, others: int = 0) -> float:
        new = self.workload.new_tokens
        return (
            2 * self.link.http_hop_s
            + self.prefill_s(history + new, 0)
            + self.kv_load_s(new)
            + self._decode_first_token_s(others, history + new)
        )

    def pull_s(self, history: int, others: int = 0) -> float:
        new = self.workload.new_tokens
        return (
            2 * self.link.http_hop_s
            + self.kv_load_s(history)
            + self.prefill_s(new, history)
            + self.kv_load_s(new)
            + self._decode_first_token_s(others, history + new)
        )

    def holder_s(self, history: int, others: int = 0) -> float:
        wait = self.step_s(0, history, others) / 2 if others else 0.0
        return self.link.http_hop_s + wait + self.step_s(self.workload.new_tokens, history, others)

    def follow_up(self, history: int, sessions: int = 1) -> FollowUp:
        limit = self.session_limit(history)
        held = sessions <= limit
        others = max(sessions - 1, 0)
        new = self.workload.new_tokens
        stall = self.step_s(new, history, others) - self.step_s(0, history, others)
        return FollowUp(
            history_tokens=history,
            sessions=sessions,
            session_limit=limit,
            seconds={
                "recompute": self.recompute_s(history, min(others, max(limit - 1, 0))),
                "pull": self.pull_s(history, others) if held else None,
                "holder": self.holder_s(history, others) if held else None,
            },
            holder_stall_s=stall if held else None,
            holder_allowed=held and (others == 0 or stall <= self.slo.itl_budget_s),
        )

    def sweep(self, histories: Iterable[int], session_points: int) -> list[FollowUp]:
        """Each history at ``session_points`` session counts from 1 up to D's memory limit."""
        rows: list[FollowUp] = []
        for history in histories:
            limit = self.session_limit(history)
            for sessions in _spread(limit, session_points):
                rows.append(self.follow_up(history, sessions))
        return rows


def _spread(limit: int, points: int) -> list[int]:
    if limit <= 1 or points <= 1:
        return [1]
    steps = [round(1 + (limit - 1) * i / (points - 1)) for i in range(points)]
    return sorted(set(steps))


@dataclass(frozen=True)
class SeedCheck:
    """The model's recompute/pull ratio against a published one."""

    case: SeedCase
    predicted_recompute_s: float
    predicted_pull_s: float

    @property
    def predicted_ratio(self) -> float:
        return self.predicted_recompute_s / self.predicted_pull_s

    @property
    def published_ratio(self) -> float:
        return self.case.published_ratio

    @property
    def relative_error(self) -> float:
        return self.predicted_ratio / self.published_ratio - 1


def check_seed(case: SeedCase, model: ClusterModel | None = None) -> SeedCheck:
    """Predict a seed case with ``model`` (default: the catalog's inputs for its model).

    The seed's own workload applies whatever ``model``'s is: the check is of the physics.
    """
    base = model or ClusterModel(case.serving)
    seeded = ClusterModel(base.serving, gpu=base.gpu, node=base.node, link=base.link, slo=base.slo)
    return SeedCheck(
        case=case,
        predicted_recompute_s=seeded.recompute_s(case.history_tokens),
        predicted_pull_s=seeded.pull_s(case.history_tokens),
    )
