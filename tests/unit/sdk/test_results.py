from agentkv._results import finish_reason, kv_path, kv_reason, reused_tokens, server_timing
from agentkv.testing import openai_httpx


def choices(*reasons):
    return {"choices": [{"index": i, "finish_reason": r} for i, r in enumerate(reasons)]}


def test_chat_finish_reasons():
    assert finish_reason(choices("stop")) == "stop"
    assert finish_reason(choices(None)) is None
    assert finish_reason(choices("stop", "tool_calls")) == "tool_calls"


def test_responses_api_finish_reasons():
    text = {"object": "response", "status": "completed", "output": [{"type": "message"}]}
    tool = {"object": "response", "status": "completed", "output": [{"type": "function_call"}]}
    running = {"object": "response", "status": "in_progress", "output": []}
    assert finish_reason(text) == "completed"
    assert finish_reason(tool) == "tool_calls"
    assert finish_reason({"type": "response.created", "response": running}) is None
    assert finish_reason({"type": "response.completed", "response": tool}) == "tool_calls"
    assert finish_reason({"type": "response.output_text.delta", "delta": "x"}) is None


def test_router_headers():
    headers = openai_httpx.Headers({"X-AgentKV-KV-Path": "reuse", "x-agentkv-reused-tokens": "640"})
    assert (kv_path(headers), reused_tokens(headers)) == ("reuse", 640)
    assert (kv_path({}), reused_tokens({})) == (None, None)
    assert reused_tokens({"x-agentkv-reused-tokens": "many"}) is None


def test_server_timing_gives_seconds_per_step():
    headers = {"server-timing": "plan;dur=1.5, prefill;dur=20, decode;dur=3.25"}
    assert server_timing(headers) == {"plan": 0.0015, "prefill": 0.02, "decode": 0.00325}


def test_kv_reason_is_the_plan_steps_description():
    headers = {"server-timing": 'plan;dur=1.5;desc="none_held", decode;dur=3;desc="x"'}
    assert kv_reason(headers) == "none_held"
    assert server_timing(headers) == {"plan": 0.0015, "decode": 0.003}
    assert kv_reason({"server-timing": "plan;desc=pull_cheaper;dur=2"}) == "pull_cheaper"
    assert kv_reason({"server-timing": "plan;dur=1.5, decode;desc=a"}) is None
    assert kv_reason({}) is None


def test_server_timing_skips_what_it_cannot_read():
    assert server_timing({}) == {}
    assert server_timing({"server-timing": "plan;dur=x, cache, decode;desc=a;dur=2"}) == {
        "decode": 0.002
    }
