from agentkv import protocol
from agentkv._tagging import TurnTags, headers_to_add, is_tool_continuation, tag_body

TAGS = TurnTags("s-1", turn=2, tool_continuation=True, session_end=False, next_turn_seconds=1.25)


def test_headers_and_body_carry_the_turn():
    assert headers_to_add(TAGS, []) == {
        "x-session-id": "s-1",
        "x-agentkv-turn": "2",
        "x-agentkv-tool-continuation": "1",
        "x-agentkv-session-end": "0",
        "x-agentkv-next-turn-seconds": "1.250",
        "x-agentkv-version": "0.1.0",
    }
    assert tag_body({"model": "m"}, TAGS) == {
        "model": "m",
        "prompt_cache_key": "s-1",
        "agentkv": {
            "session_id": "s-1",
            "turn": 2,
            "tool_continuation": True,
            "session_end": False,
            "next_turn_seconds": 1.25,
            "version": "0.1.0",
        },
    }


def test_unknown_prediction_is_omitted():
    tags = TurnTags("s", turn=1, tool_continuation=False, session_end=True, next_turn_seconds=None)
    assert protocol.HEADER_NEXT_TURN_SECONDS not in tags.headers()
    assert protocol.BODY_KEY_NEXT_TURN_SECONDS not in tags.body()


def test_present_headers_win_case_insensitively():
    added = headers_to_add(TAGS, ["X-Session-ID", "x-other"])
    assert "x-session-id" not in added
    assert added["x-agentkv-turn"] == "2"


def test_caller_prompt_cache_key_and_agentkv_object_win():
    tagged = tag_body({"prompt_cache_key": "mine", "agentkv": {"own": 1}}, TAGS)
    assert tagged["prompt_cache_key"] == "mine"
    assert tagged["agentkv"] == {"own": 1}


def test_null_prompt_cache_key_gets_the_session_id():
    assert tag_body({"prompt_cache_key": None}, TAGS)["prompt_cache_key"] == "s-1"


def test_tool_continuation_detection():
    user = {"role": "user", "content": "hi"}
    tool = {"role": "tool", "content": "42", "tool_call_id": "c"}
    assistant = {"role": "assistant", "content": "x"}
    assert is_tool_continuation({"messages": [user, tool]})
    assert not is_tool_continuation({"messages": [tool, user]})
    assert not is_tool_continuation({"messages": [user, assistant]})
    assert not is_tool_continuation({"prompt": "tool"})
    assert not is_tool_continuation({"input": "tool"})
    output = {"type": "function_call_output", "call_id": "c", "output": "42"}
    assert is_tool_continuation({"input": [user, output]})
