"""``agentkv plan``: a cluster-scale model of follow-up TTFT, labelled as a model.

What one follow-up turn would cost on prefill/decode GPU nodes per path (recompute, pull the
held KV, continue on the holder), predicted from published hardware figures and model
configurations rather than measured: ``inputs`` says what an input is, ``catalog`` holds the
published figures with their sources, ``architecture`` turns a configuration into parameters,
KV bytes and FLOPs, ``model`` into seconds, ``report`` into a table, JSON and a plot.
"""

from agentkv_server.plan.catalog import SEED_CASES, SEED_WORKLOAD, SERVINGS
from agentkv_server.plan.inputs import ModelConfig, SeedCase, ServingSpec, Source, Workload
from agentkv_server.plan.model import PATHS, ClusterModel, FollowUp, PathName, SeedCheck, check_seed
from agentkv_server.plan.report import MODEL_LABEL, SEED_TOLERANCE, Plan, build_plan

__all__ = [
    "MODEL_LABEL",
    "PATHS",
    "SEED_CASES",
    "SEED_TOLERANCE",
    "SEED_WORKLOAD",
    "SERVINGS",
    "ClusterModel",
    "FollowUp",
    "ModelConfig",
    "PathName",
    "Plan",
    "SeedCase",
    "SeedCheck",
    "ServingSpec",
    "Source",
    "Workload",
    "build_plan",
    "check_seed",
]
