"""``agentkv bench``: multi-turn agent workloads measured on every serving mode, side by side.

``workload`` says what sessions send, ``runner`` sends it through the SDK and records each
turn, ``decoders`` streams long outputs beside the turns (the concurrency dimension),
``modes`` puts a router (or nothing) in front of the engines per mode, ``kvmemory`` and
``transfers`` read the engines' metrics, ``stats`` and ``report`` turn the records into
figures, plots and a markdown summary. The pressure sweep (``--preset pressure``): ``pressure``
draws its sessions, ``pressure_run`` runs them per mode and number of sessions, ``waits``
reads the decode engines' queue waits, preemptions and peak KV, ``clairvoyant`` computes the
best reuse any retention could have had, ``pressure_report`` sets them side by side. The
overload preset (``--preset overload``): ``overload`` draws two tenants' sessions per offered
load, ``capacity`` measures what the loads are multiples of, ``sweep`` runs the points per
mode through ``tenant_runner`` (each tenant's key, openai's retries, every try recorded by
``attempts``; the router's counts by ``router_counts``), ``overload_report`` checks issue 48's
bars; ``agents12`` and ``agents12_report`` are issue 48's twelve sessions on the same machinery.
``cli`` parses ``agentkv bench``'s options, ``cli_setup`` opens the engines and each mode's
endpoint, ``sweep_cli`` runs the overload and agents12 presets.
``router`` (``agentkv bench router``, with
``router_sessions`` and ``processes``) measures what the router itself adds to a turn, on stub
engines.
"""

from agentkv_server.bench.agents12 import AgentSessions
from agentkv_server.bench.capacity import Capacity
from agentkv_server.bench.clairvoyant import Clairvoyance, best_reuse
from agentkv_server.bench.kvmemory import KVUsage
from agentkv_server.bench.modes import BASELINE, MODES, Deployment, ModeName, serve_mode
from agentkv_server.bench.overload import OverloadWorkload
from agentkv_server.bench.planned import PlannedSession, Point
from agentkv_server.bench.pressure import PressureWorkload, SessionPlan
from agentkv_server.bench.records import (
    Attempt,
    BenchResult,
    DecodeRecord,
    PressureWindow,
    RunWindow,
    SweepResult,
    TenantTurn,
    TransferRecord,
    TurnRecord,
)
from agentkv_server.bench.report import write_report
from agentkv_server.bench.runner import Runner, RunRecords, Target
from agentkv_server.bench.stats import Summary, Tpot, summarize
from agentkv_server.bench.tenant_runner import TenantRunner
from agentkv_server.bench.workload import PRESETS, Preset, ToolLatency, Workload

__all__ = [
    "BASELINE",
    "MODES",
    "PRESETS",
    "AgentSessions",
    "Attempt",
    "BenchResult",
    "Capacity",
    "Clairvoyance",
    "DecodeRecord",
    "Deployment",
    "KVUsage",
    "ModeName",
    "OverloadWorkload",
    "PlannedSession",
    "Point",
    "Preset",
    "PressureWindow",
    "PressureWorkload",
    "RunRecords",
    "RunWindow",
    "Runner",
    "SessionPlan",
    "Summary",
    "SweepResult",
    "Target",
    "TenantRunner",
    "TenantTurn",
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
