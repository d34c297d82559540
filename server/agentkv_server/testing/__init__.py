"""Test doubles and oracles shipped with agentkv: stub engines that speak vLLM's OpenAI API and
the kv_transfer_params protocol of docs/protocol.md, for unit tests, load tests and benchmarks;
``probe``, which drives real engines by hand and judges reused KV against recomputed KV."""

from agentkv_server.testing.harness import (
    InProcessRouter,
    conversation,
    in_process_router,
    serve_in_process,
    serve_on_loopback,
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
    "run_sessions",
    "serve_in_process",
    "serve_on_loopback",
    "stub_answer",
    "words",
]
