"""Test doubles and oracles shipped with agentkv: stub engines that speak vLLM's OpenAI API and
the kv_transfer_params protocol of docs/protocol.md, for unit tests, load tests and benchmarks;
``probe``, which drives real engines by hand and judges reused KV against recomputed KV."""

from agentkv_server.testing.clock import ManualClock
from agentkv_server.testing.harness import (
    InProcessRouter,
    conversation,
    in_process_router,
    plan_reason,
    serve_in_process,
    serve_on_loopback,
    tool_result,
    words,
)
from agentkv_server.testing.redis_server import RedisServer
from agentkv_server.testing.stub_engine import (
    Fault,
    RecordedRequest,
    Reporter,
    Retained,
    StubCluster,
    StubEngine,
    count_prompt_tokens,
    http_reporter,
    stub_answer,
)
from agentkv_server.testing.workload import Send, TurnOutcome, WorkloadReport, run_sessions

__all__ = [
    "Fault",
    "InProcessRouter",
    "ManualClock",
    "RecordedRequest",
    "RedisServer",
    "Reporter",
    "Retained",
    "Send",
    "StubCluster",
    "StubEngine",
    "TurnOutcome",
    "WorkloadReport",
    "conversation",
    "count_prompt_tokens",
    "http_reporter",
    "in_process_router",
    "plan_reason",
    "run_sessions",
    "serve_in_process",
    "serve_on_loopback",
    "stub_answer",
    "tool_result",
    "words",
]
