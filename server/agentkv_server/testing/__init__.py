"""Test doubles shipped with agentkv: stub engines that speak vLLM's OpenAI API and the
kv_transfer_params protocol of docs/protocol.md, for unit tests, load tests and benchmarks."""

from agentkv_server.testing.harness import InProcessRouter, conversation, in_process_router, words
from agentkv_server.testing.stub_engine import (
    Fault,
    RecordedRequest,
    Reporter,
    Retained,
    StubCluster,
    StubEngine,
    count_prompt_tokens,
    http_reporter,
)

__all__ = [
    "Fault",
    "InProcessRouter",
    "RecordedRequest",
    "Reporter",
    "Retained",
    "StubCluster",
    "StubEngine",
    "conversation",
    "count_prompt_tokens",
    "http_reporter",
    "in_process_router",
    "words",
]
