"""A tool-calling agent loop on the plain agentkv SDK: one session, one line per turn.

    .venv/bin/agentkv serve --run "python examples/tool_loop.py"       # local stack
    AGENTKV_BASE_URL=https://host/v1 python examples/tool_loop.py    # any OpenAI-compatible server

Does the task of _common.py with real tools (a file in a temporary folder, a lookup table, an
addition), printing each tool call, then per model call its TTFT and whether the router
reused the KV cache, the answer, and a summary of first-turn against follow-up TTFT.
"""

from __future__ import annotations

from typing import Any

from _common import (
    ANSWER_FORMAT,
    API_KEY,
    BASE_URL,
    LOGIT_BIAS,
    MAX_TOKENS,
    PROMPT,
    SYSTEM,
    TOOL_SPECS,
    TURNS,
    format_answer,
    format_call,
    format_turn,
    model_name,
    run_tool,
    summary,
    tool_for_turn,
)

import agentkv


def turn_options(turn: int) -> dict[str, Any]:
    """The step's tool on every turn but the last, which answers in ANSWER_FORMAT."""
    if turn == TURNS:
        return {"tool_choice": "none", "response_format": ANSWER_FORMAT}
    return {"tool_choice": {"type": "function", "function": {"name": tool_for_turn(turn)}}}


def main() -> None:
    client = agentkv.OpenAI(base_url=BASE_URL, api_key=API_KEY)
    model = model_name()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PROMPT},
    ]
    print(f"agentkv tool loop: {TURNS} turns of {model} at {BASE_URL}", flush=True)
    print(f"task: {PROMPT}", flush=True)
    answer = ""
    with agentkv.session() as session:
        for turn in range(1, TURNS + 1):
            if turn == TURNS:
                session.end_next_turn()
            reply = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOL_SPECS,
                max_tokens=MAX_TOKENS,
                temperature=0,
                **turn_options(turn),
                **({"logit_bias": LOGIT_BIAS} if LOGIT_BIAS else {}),
            )
            print(format_turn(session.last_turn), flush=True)
            message = reply.choices[0].message
            answer = message.content or ""
            messages.extend(follow_up(message))
    print(f"answer: {format_answer(answer)}", flush=True)
    print(summary(session), flush=True)


def follow_up(message: Any) -> list[dict[str, Any]]:
    """The assistant message, then its tools' results (or a nudge when it called none)."""
    calls = [call.model_dump() for call in message.tool_calls or []]
    assistant: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if calls:
        assistant["tool_calls"] = calls
    results = []
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        result = run_tool(name, arguments)
        print(format_call(name, arguments, result), flush=True)
        results.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return [assistant, *(results or [{"role": "user", "content": "Go on."}])]


if __name__ == "__main__":
    main()
