"""What the examples share: where the server is, the task and its real tools, the turn report.

The task: read a file in a temporary folder, look up the capital of the country it names in a
table, add two numbers the user gives, then answer. Each tool turn forces a call
(``tool_choice``: the step's tool, or ``required``); the tools really run. The schemas are
bounded (file names and countries are ``enum`` lists, numbers have a range, ``strict`` tools) and
the answer turn is a structured output (``ANSWER_FORMAT``): a 135M model decodes its arguments
and its answer under them. The system prompt works one whole example through with other names
and numbers, so what the model copies is the pattern, not the values. docs/integrations.md has
the measured call rates.

Environment: AGENTKV_BASE_URL (default http://127.0.0.1:8000/v1, what ``agentkv serve`` listens
on), AGENTKV_MODEL (default: the server's first model), OPENAI_API_KEY (default "-"),
AGENTKV_TURNS (model calls per run, default 4, at least 2), AGENTKV_TOOL_LOGIT_BIAS (a JSON
``logit_bias`` sent with every request; ``agentkv serve`` sets it only for a random-weight test
model, whose words are noise and which never closes a JSON string without it).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

import agentkv

BASE_URL = os.environ.get("AGENTKV_BASE_URL", "http://127.0.0.1:8000/v1")
API_KEY = os.environ.get("OPENAI_API_KEY", "-")
TURNS = max(2, int(os.environ.get("AGENTKV_TURNS", "4")))
LOGIT_BIAS: dict[str, int] | None = json.loads(os.environ.get("AGENTKV_TOOL_LOGIT_BIAS") or "null")
MAX_TOKENS = 48

CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Spain": "Madrid"}
FILE_NAMES = ("notes.txt", "todo.txt", "trip.txt")


@dataclass(frozen=True)
class Task:
    """One instance of the task: which file names which country, and the two numbers."""

    file: str
    country: str
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return (
            f"Read the file {self.file}, look up the capital of the country in it, "
            f"and add {self.a} and {self.b}."
        )

    def files(self) -> dict[str, str]:
        """The work folder: the task's file names the country, the others do not."""
        other = {"notes.txt": "Buy bread and milk.\n", "todo.txt": "Call Anna.\n"}
        trip = {"trip.txt": "Pack the bags.\n"}
        return {**other, **trip, self.file: f"Trip to {self.country} in May.\n"}

    def plan(self) -> list[tuple[str, dict[str, Any], str]]:
        """Each step's tool, its right arguments, and what the tool answers."""
        return [
            ("read_file", {"name": self.file}, self.files()[self.file]),
            ("capital", {"country": self.country}, CAPITALS[self.country]),
            ("add", {"a": self.a, "b": self.b}, str(self.a + self.b)),
        ]

    def answer(self) -> dict[str, Any]:
        """The right final answer, as ANSWER_FORMAT shapes it."""
        return {
            "country": self.country,
            "capital": CAPITALS[self.country],
            "total": self.a + self.b,
        }


TASK = Task(file="trip.txt", country="Japan", a=120, b=45)
PROMPT = TASK.prompt
# One worked example of the whole task, with names and numbers the task never uses (Peru is in
# no table, plan.txt in no folder): the model copies the call format and where arguments come
# from. The user gives the numbers: SmolLM2-135M copies numbers from the request, but not out of
# a tool result, where it wrote the worked example's instead (docs/integrations.md).
SYSTEM = (
    "You are a helpful assistant with tools. Call one tool at a time, with arguments taken "
    "from the user's request and the tool results. Example:\n"
    "user: Read plan.txt, look up the capital of the country in it, and add 7 and 8.\n"
    'assistant: <tool_call>{"name": "read_file", "arguments": {"name": "plan.txt"}}</tool_call>\n'
    "tool: Visit Peru in June.\n"
    'assistant: <tool_call>{"name": "capital", "arguments": {"country": "Peru"}}</tool_call>\n'
    "tool: Lima\n"
    'assistant: <tool_call>{"name": "add", "arguments": {"a": 7, "b": 8}}</tool_call>\n'
    "tool: 15\n"
    "assistant: The capital of Peru is Lima, and 7 plus 8 is 15."
)

_folder = Path(tempfile.mkdtemp(prefix="agentkv-example-"))
for _name, _text in TASK.files().items():
    (_folder / _name).write_text(_text)


def model_name() -> str:
    """AGENTKV_MODEL, else the first model the server lists."""
    configured = os.environ.get("AGENTKV_MODEL")
    if configured:
        return configured
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY).models.list().data[0].id


def read_file(name: str) -> str:
    """Reads a text file of the work folder."""
    path = _folder / Path(str(name)).name
    return path.read_text() if path.is_file() else f"error: no file named {name!r}"


def add(a: int, b: int) -> str:
    """Adds two whole numbers."""
    try:
        return str(int(a) + int(b))
    except (TypeError, ValueError):
        return "error: a and b must be whole numbers"


def capital(country: str) -> str:
    """Looks up the capital city of a country."""
    return CAPITALS.get(str(country), f"error: {country!r} is not in the table")


TOOLS: dict[str, Callable[..., str]] = {"read_file": read_file, "capital": capital, "add": add}
PLAN = [tool for tool, _, _ in TASK.plan()]  # the tool each step calls, in order


def _object(**properties: dict[str, Any]) -> dict[str, Any]:
    """A strict JSON schema of an object with exactly these properties."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


_NUMBER = {"type": "integer", "minimum": 0, "maximum": 999}
# Bounded schemas: the server decodes arguments under them (OpenAI's ``strict`` function tools).
SCHEMAS: dict[str, dict[str, Any]] = {
    "read_file": _object(name={"type": "string", "enum": list(FILE_NAMES)}),
    "capital": _object(country={"type": "string", "enum": sorted(CAPITALS)}),
    "add": _object(a=_NUMBER, b=_NUMBER),
}
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


# The answer turn: a structured output the model fills from the tool results. Free text after
# three calls is a fourth call written out as text on this model; a free capital string was
# "Lasagna", a capital alone always the first one it liked; naming the country first, it picks
# the capital that goes with it (docs/integrations.md).
ANSWER_SCHEMA = _object(
    country={"type": "string", "enum": sorted(CAPITALS)},
    capital={"type": "string", "enum": sorted(CAPITALS.values())},
    total={"type": "integer", "minimum": 0, "maximum": 9999},
)
ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
}


def format_answer(content: str | None) -> str:
    """The answer turn's JSON as a sentence; any other text as it came."""
    try:
        answer = json.loads(content or "")
        return f"the capital of {answer['country']} is {answer['capital']}, the total is {answer['total']}"
    except (ValueError, TypeError, KeyError):
        return (content or "").strip()


def tool_for_turn(turn: int) -> str:
    """The tool a turn (1-based) calls: the plan's steps in order."""
    return PLAN[(turn - 1) % len(PLAN)]


def run_tool(name: str, arguments: str | dict[str, Any] | None) -> str:
    """Runs a tool; arguments that do not fit its schema come back as an error message."""
    tool = TOOLS.get(name)
    if tool is None:
        return f"error: no tool named {name!r}"
    kwargs = _parse(arguments)
    expected = SCHEMAS[name]["required"]
    if sorted(kwargs) != sorted(expected):
        return f"error: {name} takes {', '.join(expected)}; got {json.dumps(kwargs)}"
    return tool(**kwargs)


def _parse(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def format_call(name: str, arguments: str | dict[str, Any] | None, result: str) -> str:
    """One line per tool call: what the model asked for and what the tool answered."""
    shown = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f"  tool {name}({shown}) -> {result.strip()!r}"


def format_turn(info: agentkv.TurnInfo) -> str:
    """One line per model call: turn, TTFT, and whether the KV cache was reused."""
    ttft = "   n/a" if info.ttft_seconds is None else f"{info.ttft_seconds:6.3f}"
    kv = info.kv_path or "no router"
    if info.reused_tokens:
        kv += f" ({info.reused_tokens} tokens reused)"
    after = "after tool results" if info.tool_continuation else "after user input"
    return f"turn {info.turn:2d}  ttft {ttft} s  kv {kv:<28}  {after}"


def summary(session: agentkv.Session) -> str:
    """Turns, how many reused KV, and the first turn's TTFT against the follow-ups'."""
    turns = session.turns
    reused = [t for t in turns if t.kv_path in ("local", "reuse")]
    later = [t.ttft_seconds for t in turns[1:] if t.ttft_seconds is not None]
    first = turns[0].ttft_seconds if turns and turns[0].ttft_seconds is not None else None
    parts = [
        f"session {session.id}: {len(turns)} turns",
        f"KV reused on {len(reused)} ({sum(t.reused_tokens or 0 for t in reused)} tokens)",
    ]
    if first is not None:
        parts.append(f"TTFT first turn {first:.3f} s")
    if later:
        mean = sum(later) / len(later)
        parts.append(f"follow-ups mean {mean:.3f} s")
        if first is not None and mean > 0:
            verdict = "faster" if mean < first else "NOT faster"
            parts.append(f"follow-ups {first / mean:.1f}x {verdict} than the first turn")
    return ", ".join(parts)


def report(session: agentkv.Session, answer: str | None = None) -> None:
    """Prints every turn of ``session``, the final answer, then the summary."""
    for info in session.turns:
        print(format_turn(info), flush=True)
    if answer is not None:
        print(f"answer: {format_answer(answer)}", flush=True)
    print(summary(session), flush=True)
