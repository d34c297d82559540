"""The cluster model's output: a plan (rows, seed check, inputs) as a table, JSON and a plot.

The plot uses matplotlib's Agg canvas, imported only when a plot is written: ``agentkv plan``
without the ``bench`` extra still prints the table and the JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv_server.plan import architecture as arch
from agentkv_server.plan.catalog import SEED_CASES
from agentkv_server.plan.inputs import AssumedEfficiency, Source
from agentkv_server.plan.model import PATHS, ClusterModel, FollowUp, SeedCheck, check_seed

__all__ = [
    "MODEL_LABEL",
    "SEED_TOLERANCE",
    "Plan",
    "build_plan",
    "plan_json",
    "render_table",
    "write_plot",
]

MODEL_LABEL = (
    "MODEL, NOT A MEASUREMENT: predicted from published hardware specifications, model "
    "configurations and published measurements of other systems (docs/cluster-model.md)"
)
SEED_TOLERANCE = 0.15
_COLORS = {"recompute": "tab:gray", "pull": "tab:blue", "holder": "tab:green"}


@dataclass(frozen=True)
class Plan:
    """Predictions for each served model plus the seed check."""

    models: tuple[ClusterModel, ...]
    rows: dict[str, list[FollowUp]]
    seed_checks: tuple[SeedCheck, ...]


def build_plan(
    models: Sequence[ClusterModel],
    histories: Sequence[int],
    session_points: int,
    seed_models: Mapping[str, ClusterModel] | None = None,
) -> Plan:
    """Sweep each model; check the seed with ``seed_models`` (by model name) where given, the
    catalog's inputs otherwise."""
    seed_models = seed_models or {}
    return Plan(
        models=tuple(models),
        rows={m.serving.model.name: m.sweep(histories, session_points) for m in models},
        seed_checks=tuple(
            check_seed(case, seed_models.get(case.serving.model.name)) for case in SEED_CASES
        ),
    )


# table ----------------------------------------------------------------------------------------


def render_table(plan: Plan) -> str:
    lines = [MODEL_LABEL, ""]
    for check in plan.seed_checks:
        lines.append(_seed_line(check))
    for model in plan.models:
        lines += ["", _model_heading(model), _header(), _rule()]
        lines += [_row(r) for r in plan.rows[model.serving.model.name]]
    budget = plan.models[0].slo.itl_budget_s
    lines += ["", _legend_line(budget)]
    return "\n".join(lines)


def _legend_line(itl_budget_s: float) -> str:
    return (
        "sessions: held on the decode engine / its memory limit; holder stall: how long the "
        "holder path holds up the other sessions' decoding (! over the "
        f"{_ms(itl_budget_s)} ms ITL budget, so the policy does not pick it); vs PATH: that "
        "fixed path's TTFT over the policy's pick."
    )


def _seed_line(check: SeedCheck) -> str:
    verdict = "within" if abs(check.relative_error) <= SEED_TOLERANCE else "OUTSIDE"
    return (
        f"seed check, {check.case.label}: predicted {_ms(check.predicted_recompute_s)} -> "
        f"{_ms(check.predicted_pull_s)} ms ({check.predicted_ratio:.2f}x), published "
        f"{_ms(check.case.recompute_ttft_s)} -> {_ms(check.case.pull_ttft_s)} ms "
        f"({check.published_ratio:.2f}x): {check.relative_error:+.0%}, {verdict} "
        f"{SEED_TOLERANCE:.0%}"
    )


def _model_heading(model: ClusterModel) -> str:
    serving = model.serving
    per_token = arch.kv_bytes_per_token(serving.model, serving.kv_cache_precision)
    return (
        f"{serving.model.name}, TP{serving.tensor_parallel} per engine on {model.node.name}, "
        f"KV {per_token / 1024:.0f} KiB/token, prefill MFU {model.mfu:.0%}, "
        f"{model.workload.new_tokens} new tokens per turn, "
        f"decode holds {model.kv_capacity_tokens():,} tokens"
    )


_COLUMNS = ("history", "sessions", "recompute", "pull", "holder", "holder stall", "best",
            "vs recompute", "vs pull", "vs holder")  # fmt: skip
_WIDTHS = (7, 9, 9, 8, 7, 12, 9, 12, 7, 9)


def _header() -> str:
    return "  ".join(c.rjust(w) for c, w in zip(_COLUMNS, _WIDTHS))


def _rule() -> str:
    return "  ".join("-" * w for w in _WIDTHS)


def _row(r: FollowUp) -> str:
    margins = r.margins()
    cells = (
        f"{r.history_tokens // 1024}k",
        f"{r.sessions}/{r.session_limit}",
        *(_cell_ms(r.seconds[p]) for p in PATHS),
        _cell_stall(r),
        r.best,
        *(_cell_margin(margins[p]) for p in PATHS),
    )
    return "  ".join(c.rjust(w) for c, w in zip(cells, _WIDTHS))


def _cell_ms(seconds: float | None) -> str:
    return "evicted" if seconds is None else f"{_ms(seconds)} ms"


def _cell_stall(r: FollowUp) -> str:
    if r.holder_stall_s is None or r.sessions == 1:
        return "-"
    return _cell_ms(r.holder_stall_s) + ("" if r.holder_allowed else " !")


def _cell_margin(margin: float | None) -> str:
    return "-" if margin is None else f"{margin:.2f}x"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


# JSON -----------------------------------------------------------------------------------------


def plan_json(plan: Plan, plot: Path | None = None) -> dict[str, Any]:
    return {
        "label": MODEL_LABEL,
        "seed_check": [_seed_json(c) for c in plan.seed_checks],
        "seed_tolerance": SEED_TOLERANCE,
        "models": [_model_json(m, plan.rows[m.serving.model.name]) for m in plan.models],
        "plot": None if plot is None else str(plot),
    }


def _seed_json(check: SeedCheck) -> dict[str, Any]:
    case = check.case
    return {
        "case": case.label,
        "model": case.serving.model.name,
        "history_tokens": case.history_tokens,
        "predicted_ratio": round(check.predicted_ratio, 3),
        "published_ratio": round(check.published_ratio, 3),
        "relative_error": round(check.relative_error, 3),
        "within_tolerance": abs(check.relative_error) <= SEED_TOLERANCE,
        "predicted_ms": {
            "recompute": _round_ms(check.predicted_recompute_s),
            "pull": _round_ms(check.predicted_pull_s),
        },
        "published_ms": {
            "recompute": _round_ms(case.recompute_ttft_s),
            "pull": _round_ms(case.pull_ttft_s),
        },
        "source": _source_json(case.source),
    }


def _model_json(model: ClusterModel, rows: list[FollowUp]) -> dict[str, Any]:
    return {
        "name": model.serving.model.name,
        "inputs": _inputs_json(model),
        "derived": _derived_json(model),
        "rows": [_row_json(r) for r in rows],
    }


def _row_json(r: FollowUp) -> dict[str, Any]:
    return {
        "history_tokens": r.history_tokens,
        "sessions": r.sessions,
        "session_limit": r.session_limit,
        "ttft_ms": {p: _round_ms(s) for p, s in r.seconds.items()},
        "best": r.best,
        "policy_margin": {p: None if m is None else round(m, 3) for p, m in r.margins().items()},
        "holder_stall_ms": _round_ms(r.holder_stall_s),
        "holder_allowed": r.holder_allowed,
    }


def _round_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _source_json(source: Source) -> dict[str, str]:
    return {"kind": source.kind, "reference": source.reference}


def _cited(value: Any, unit: str, source: Source) -> dict[str, Any]:
    return {"value": value, "unit": unit, "source": _source_json(source)}


def _inputs_json(model: ClusterModel) -> dict[str, Any]:
    gpu, node, link, serving = model.gpu, model.node, model.link, model.serving
    config = serving.model
    efficiency = serving.prefill_efficiency
    if isinstance(efficiency, AssumedEfficiency):
        mfu = _cited(efficiency.mfu, "fraction of dense peak", efficiency.source)
    else:
        mfu = _cited(
            {"prompt_tokens": efficiency.prompt_tokens, "ttft_s": efficiency.ttft_s},
            "measured prefill the MFU is derived from",
            efficiency.source,
        )
    return {
        "gpu": {
            "name": gpu.name,
            "hbm_bytes": _cited(gpu.hbm_bytes, "B", gpu.source),
            "hbm_bytes_per_s": _cited(gpu.hbm_bytes_per_s, "B/s", gpu.source),
            "dense_flops": _cited(gpu.dense_flops, "FLOP/s", gpu.source),
        },
        "node": {
            "name": node.name,
            "gpus": _cited(node.gpus, "GPUs", node.source),
            "network_bits_per_s": _cited(node.network_bits_per_s, "bit/s", node.source),
        },
        "link": {
            "efficiency": _cited(link.efficiency, "fraction", link.sources["efficiency"]),
            "per_descriptor_s": _cited(
                link.per_descriptor_s, "s", link.sources["per_descriptor_s"]
            ),
            "handover_s": _cited(link.handover_s, "s", link.sources["handover_s"]),
            "http_hop_s": _cited(link.http_hop_s, "s", link.sources["http_hop_s"]),
        },
        "model_config": _cited(_config_fields(config), "config.json fields", config.source),
        "serving": {
            name: _cited(getattr(serving, name), "", source)
            for name, source in serving.sources.items()
        }
        | {"prefill_efficiency": mfu},
        "slo": {"itl_budget_s": _cited(model.slo.itl_budget_s, "s", model.slo.source)},
        "workload": {
            "new_tokens": _cited(model.workload.new_tokens, "tokens", model.workload.source),
            "output_tokens": _cited(model.workload.output_tokens, "tokens", model.workload.source),
        },
    }


def _config_fields(config: Any) -> dict[str, Any]:
    skip = {"name", "source", "published_params"}
    unset = (None, 0)
    return {
        k: v
        for k, v in vars(config).items()
        if k not in skip and (isinstance(v, bool) or v not in unset)
    }


def _derived_json(model: ClusterModel) -> dict[str, Any]:
    serving = model.serving
    config = serving.model
    tp = serving.tensor_parallel
    return {
        "total_params": arch.total_params(config),
        "active_params": arch.active_params(config),
        "published_params": config.published_params,
        "kv_bytes_per_token": arch.kv_bytes_per_token(config, serving.kv_cache_precision),
        "kv_bytes_per_token_per_rank": arch.kv_bytes_per_token_per_rank(
            config, serving.kv_cache_precision, tp
        ),
        "prefill_mfu": round(model.mfu, 4),
        "decode_kv_capacity_tokens": model.kv_capacity_tokens(),
    }


# plot -----------------------------------------------------------------------------------------


def write_plot(plan: Plan, path: Path) -> Path:
    """Follow-up TTFT against history per path, one panel per model, seed points marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.2 * len(plan.models), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(plan.models), squeeze=False)[0]
    for ax, model in zip(axes, plan.models):
        _plot_model(ax, model, plan)
    figure.suptitle("agentkv plan: a model, not a measurement", fontsize=10)
    figure.savefig(path, dpi=120)
    return path


def _plot_model(ax: Any, model: ClusterModel, plan: Plan) -> None:
    name = model.serving.model.name
    rows = plan.rows[name]
    for sessions_at, style in (("one", "-"), ("limit", "--")):
        picked = _rows_at(rows, sessions_at)
        for path in PATHS:
            points = [(r.history_tokens, r.seconds[path]) for r in picked]
            points = [(h, s) for h, s in points if s is not None]
            if points:
                label = f"{path} ({'1 session' if sessions_at == 'one' else 'memory limit'})"
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker="o", markersize=3, color=_COLORS[path], label=label)
    for check in plan.seed_checks:
        if check.case.serving.model.name == name:
            history = check.case.history_tokens
            ax.plot([history] * 2, [check.case.recompute_ttft_s, check.case.pull_ttft_s],
                    "k*", markersize=9, label="published (seed)")  # fmt: skip
    ax.set(xscale="log", yscale="log", title=name, xlabel="history held (tokens)",
           ylabel="follow-up TTFT (s)")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def _rows_at(rows: list[FollowUp], sessions_at: str) -> list[FollowUp]:
    by_history: dict[int, list[FollowUp]] = {}
    for r in rows:
        by_history.setdefault(r.history_tokens, []).append(r)
    pick = min if sessions_at == "one" else max
    return [pick(group, key=lambda r: r.sessions) for group in by_history.values()]
