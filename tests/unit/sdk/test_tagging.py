from openai import omit
from openai.types.chat import ChatCompletionMessage

from agentkv import protocol
from agentkv._tagging import TurnTags, is_tool_continuation, tag_request

TAGS = TurnTags("s-1", turn=2, tool_continuation=True, session_end=False, next_turn_seconds=1.25)


def tag(kwargs, *, send_body=True, preset_headers=None):
    return tag_request(kwargs, TAGS, send_body=send_body, preset_headers=preset_headers or {})


def test_headers_and_body_carry_the_turn():
    tagged = tag({"model": "m"})
    assert tagged["extra_headers"] == {
        "x-session-id": "s-1",
        "x-agentkv-turn": "2",
        "x-agentkv-tool-continuation": "1",
        "x-agentkv-session-end": "0",
        "x-agentkv-next-turn-seconds": "1.250",
        "x-agentkv-version": "0.1.0",
    }
    assert tagged["extra_body"] == {
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
    assert tagged["model"] == "m"


def test_unknown_prediction_is_omitted():
    tags = TurnTags("s", turn=1, tool_continuation=False, session_end=True, next_turn_seconds=None)
    assert protocol.HEADER_NEXT_TURN_SECONDS not in tags.headers()
    assert protocol.BODY_KEY_NEXT_TURN_SECONDS not in tags.body()


def test_caller_headers_win_case_insensitively():
    tagged = tag({"extra_headers": {"X-Session-ID": "mine", "x-other": "1"}})
    headers = tagged["extra_headers"]
    assert headers["X-Session-ID"] == "mine"
    assert "x-session-id" not in headers
    assert headers["x-other"] == "1"
    assert headers["x-agentkv-turn"] == "2"


def test_client_default_headers_win():
    tagged = tag({}, preset_headers={"X-Session-Id": "from-client"})
    assert "x-session-id" not in tagged["extra_headers"]


def test_caller_prompt_cache_key_and_extra_body_win():
    tagged = tag({"prompt_cache_key": "mine", "extra_body": {"agentkv": {"own": 1}, "k": "v"}})
    assert tagged["prompt_cache_key"] == "mine"
    assert "prompt_cache_key" not in tagged["extra_body"]
    assert tagged["extra_body"]["agentkv"] == {"own": 1}
    assert tagged["extra_body"]["k"] == "v"


def test_unset_prompt_cache_key_gets_the_session_id():
    for unset in (None, omit):
        assert tag({"prompt_cache_key": unset})["extra_body"]["prompt_cache_key"] == "s-1"


def test_headers_only():
    tagged = tag({"extra_body": {"k": "v"}}, send_body=False)
    assert tagged["extra_body"] == {"k": "v"}
    assert tagged["extra_headers"]["x-session-id"] == "s-1"


def test_tool_continuation_detection():
    user = {"role": "user", "content": "hi"}
    tool = {"role": "tool", "content": "42", "tool_call_id": "c"}
    assistant = ChatCompletionMessage(role="assistant", content="x")
    assert is_tool_continuation({"messages": [user, tool]})
    assert not is_tool_continuation({"messages": [tool, user]})
    assert not is_tool_continuation({"messages": [user, assistant]})
    assert not is_tool_continuation({"prompt": "tool"})
    assert not is_tool_continuation({"input": "tool"})
    output = {"type": "function_call_output", "call_id": "c", "output": "42"}
    assert is_tool_continuation({"input": [user, output]})
