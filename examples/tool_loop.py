"""A tool-calling agent loop on the plain agentkv SDK: one session, one line per turn.

    .venv/bin/agentkv serve --run "python examples/tool_loop.py"       # local stack
    AGENTKV_BASE_URL=https://host/v1 python examples/tool_loop.py    # any OpenAI-compatible server

Prints, per model call, its TTFT and whether the router reused the KV cache, then a summary.
"""

from __future__ import annotations

from typing import Any

from _common import (
    API_KEY,
    BASE_URL,
    LOGIT_BIAS,
    MAX_TOKENS,
    PROMPT,
    SCHEMAS,
    TOOLS,
    TURNS,
    format_turn,
    model_name,
    run_tool,
    summary,
    tool_for_turn,
)

import agentkv

TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": tool.__doc__,
            "parameters": SCHEMAS[name],
            "strict": True,
        },
    }
    for name, tool in TOOLS.items()
]


def tool_choice(turn: int) -> Any:
    """Forces a tool on every turn but the last, which must answer in text."""
    if turn == TURNS:
        return "none"
    return {"type": "function", "function": {"name": tool_for_turn(turn)}}


def main() -> None:
    client = agentkv.OpenAI(base_url=BASE_URL, api_key=API_KEY)
    model = model_name()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel planner. Use the tools."},
        {"role": "user", "content": PROMPT},
    ]
    print(f"agentkv tool loop: {TURNS} turns of {model} at {BASE_URL}", flush=True)
    with agentkv.session() as session:
        for turn in range(1, TURNS + 1):
            if turn == TURNS:
                session.end_next_turn()
            reply = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOL_SPECS,
                tool_choice=tool_choice(turn),
                max_tokens=MAX_TOKENS,
                temperature=0,
                **({"logit_bias": LOGIT_BIAS} if LOGIT_BIAS else {}),
            )
            print(format_turn(session.last_turn), flush=True)
            messages.extend(follow_up(reply.choices[0].message))
    print(summary(session), flush=True)


def follow_up(message: Any) -> list[dict[str, Any]]:
    """The assistant message, then its tools' results (or a nudge when it called none)."""
    calls = [call.model_dump() for call in message.tool_calls or []]
    assistant: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if calls:
        assistant["tool_calls"] = calls
    results = [
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": run_tool(call["function"]["name"], call["function"]["arguments"]),
        }
        for call in calls
    ]
    return [assistant, *(results or [{"role": "user", "content": "Go on."}])]


if __name__ == "__main__":
    main()
