"""``agentkv bench``: multi-turn agent workloads measured on every serving mode, side by side.

``workload`` says what sessions send, ``runner`` sends it through the SDK and records each
turn, ``modes`` puts a router (or nothing) in front of the engines per mode, ``stats`` and
``report`` turn the records into figures, plots and a markdown summary.
"""

from agentkv_server.bench.kvmemory import KVUsage
from agentkv_server.bench.modes import BASELINE, MODES, Deployment, ModeName, serve_mode
from agentkv_server.bench.records import BenchResult, TurnRecord
from agentkv_server.bench.report import write_report
from agentkv_server.bench.runner import Runner, Target
from agentkv_server.bench.stats import Summary, summarize
from agentkv_server.bench.workload import PRESETS, Preset, ToolLatency, Workload

__all__ = [
    "BASELINE",
    "MODES",
    "PRESETS",
    "BenchResult",
    "Deployment",
    "KVUsage",
    "ModeName",
    "Preset",
    "Runner",
    "Summary",
    "Target",
    "ToolLatency",
    "TurnRecord",
    "Workload",
    "serve_mode",
    "summarize",
    "write_report",
]
