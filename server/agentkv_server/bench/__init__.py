"""``agentkv bench``: multi-turn agent workloads measured on every serving mode, side by side.

``workload`` says what sessions send, ``runner`` sends it through the SDK and records each
turn, ``decoders`` streams long outputs beside the turns (the concurrency dimension),
``modes`` puts a router (or nothing) in front of the engines per mode, ``kvmemory`` and
``transfers`` read the engines' metrics, ``stats`` and ``report`` turn the records into
figures, plots and a markdown summary. The pressure sweep (``--preset pressure``): ``pressure``
draws its sessions, ``pressure_run`` runs them per mode and number of sessions, ``waits``
reads the decode engines' queue waits, preemptions and peak KV, ``clairvoyant`` computes the
best reuse any retention could have had, ``pressure_report`` sets them side by side.
``router`` (``agentkv bench router``, with
``router_sessions`` and ``processes``) measures what the router itself adds to a turn, on stub
engines.
"""

from agentkv_server.bench.clairvoyant import Clairvoyance, best_reuse
from agentkv_server.bench.kvmemory import KVUsage
from agentkv_server.bench.modes import BASELINE, MODES, Deployment, ModeName, serve_mode
from agentkv_server.bench.pressure import PressureWorkload, SessionPlan
from agentkv_server.bench.records import (
    BenchResult,
    DecodeRecord,
    PressureWindow,
    TransferRecord,
    TurnRecord,
)
from agentkv_server.bench.report import write_report
from agentkv_server.bench.runner import Runner, RunRecords, Target
from agentkv_server.bench.stats import Summary, Tpot, summarize
from agentkv_server.bench.workload import PRESETS, Preset, ToolLatency, Workload

__all__ = [
    "BASELINE",
    "MODES",
    "PRESETS",
    "BenchResult",
    "Clairvoyance",
    "DecodeRecord",
    "Deployment",
    "KVUsage",
    "ModeName",
    "Preset",
    "PressureWindow",
    "PressureWorkload",
    "RunRecords",
    "Runner",
    "SessionPlan",
    "Summary",
    "Target",
    "ToolLatency",
    "Tpot",
    "TransferRecord",
    "TurnRecord",
    "Workload",
    "best_reuse",
    "serve_mode",
    "summarize",
    "write_report",
]
