"""The Grafana dashboard queries only metrics that exist: the router's (from its registry) and
vLLM's (from the installed vLLM's source), under the sample names Prometheus stores."""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from agentkv_server.router.auth import METRICS_PATH
from agentkv_server.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "agentkv-dashboard.json"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "info": ("",),
}
_NAME = re.compile(r"\b(agentkv_[a-z_]+|vllm:[a-z_]+)")
_DEFINITION = re.compile(r'name="(vllm:[a-z_]+)"')
_KIND = re.compile(r"(histogram|counter|gauge)", re.IGNORECASE)


def exported(kind: str, name: str) -> set[str]:
    return {name + suffix for suffix in _SUFFIXES[kind]}


@cache
def router_samples() -> frozenset[str]:
    names: set[str] = set()
    for family in RouterMetrics().registry.collect():
        names |= exported(family.type, family.name)
    return frozenset(names)


@cache
def vllm_samples() -> frozenset[str]:
    """vLLM's metric names with their type: the constructor just before each ``name=``."""
    names: set[str] = set()
    spec = importlib.util.find_spec("vllm")  # its source, without importing it
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    for path in Path(spec.origin).parent.rglob("*.py"):
        text = path.read_text(errors="replace")
        for match in _DEFINITION.finditer(text):
            kinds = _KIND.findall(text[max(0, match.start() - 300) : match.start()])
            if kinds:
                names |= exported(kinds[-1].lower(), match.group(1))
    return frozenset(names)


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def unknown_metrics(expressions: list[str]) -> list[str]:
    known = router_samples() | vllm_samples()
    return sorted({name for expr in expressions for name in _NAME.findall(expr)} - known)


def test_the_dashboard_queries_only_exported_metrics() -> None:
    expressions = dashboard_expressions()
    assert expressions
    assert unknown_metrics(expressions) == []


def test_the_dashboard_covers_every_router_metric() -> None:
    queried = {name for expr in dashboard_expressions() for name in _NAME.findall(expr)}
    families = {f.name for f in RouterMetrics().registry.collect()}
    uncovered = [f for f in families if not any(name.startswith(f) for name in queried)]
    assert uncovered == []


@pytest.mark.parametrize(
    "expr",
    [
        "rate(agentkv_turns[5m])",  # a counter without _total
        "agentkv_ttft_seconds",  # a histogram without _bucket/_sum/_count
        "vllm:kv_cache_usage",  # a misspelt vLLM gauge
        "rate(vllm:num_requests_running_total[5m])",  # a gauge read as a counter
    ],
)
def test_the_check_refuses_names_nobody_exports(expr: str) -> None:
    assert unknown_metrics([expr]) != []


def test_the_scrape_config_matches_the_dashboard() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["agentkv-router"]["metrics_path"] == METRICS_PATH
    roles = {
        target["labels"]["role"] for target in jobs["vllm"]["static_configs"] if "labels" in target
    }
    assert roles == {"prefill", "decode"}
    # Engine panels group by the role label the scrape config sets.
    assert all("role" in expr for expr in dashboard_expressions() if "vllm:" in expr)
