#!/usr/bin/env python
"""How often does the served model make a usable tool call on the examples' task?

Runs the three steps of examples/_common.py's task (read a file, add two prices found in it, look
a capital up) over ``--variants`` variants of the request (other items, other countries), each
step with the correct history before it, under these conditions (each one change from the examples' setting, the first row):

  tool_choice  named (the step's tool), required (any tool), auto (the model decides);
  schemas      bounded (enum file names and countries, numbers 0-999) or plain (type only);
  system       few-shot (the examples' system prompt: one worked call) or plain.

A call is *valid* when the answer holds a parsed call of a known tool whose arguments match the
bounded schema, *right* when it is the step's tool with the expected arguments; *runaway* counts
answers cut at max_tokens. Greedy decoding, so one run per variant says it all.

    flock /tmp/agentkv-engines.lock timeout 900 .venv/bin/python scripts/measure_tool_calls.py
    .venv/bin/python scripts/measure_tool_calls.py --base-url http://127.0.0.1:8000/v1

Without ``--base-url`` it starts one engine of ``--model`` (default: the real default model).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from _common import CAPITALS, FILES, SCHEMAS, SYSTEM, TOOL_SPECS

from agentkv_server.bundle.stack import Stack, StackConfig

PLAIN_SYSTEM = "You are a helpful assistant with tools."
PRICES = {"bread": 3, "milk": 2, "cheese": 7}
CONDITIONS = (  # tool_choice, schemas, system
    ("named", "bounded", "few-shot"),
    ("named", "plain", "few-shot"),
    ("named", "bounded", "plain"),
    ("required", "bounded", "few-shot"),
    ("required", "plain", "few-shot"),
    ("auto", "bounded", "few-shot"),
    ("auto", "bounded", "plain"),
)
MAX_TOKENS = 48


@dataclass(frozen=True)
class Step:
    tool: str
    expected: dict[str, Any]
    messages: list[dict[str, Any]]


def variants(count: int) -> list[tuple[str, str, str]]:
    pairs = list(itertools.permutations(PRICES, 2))
    countries = sorted(CAPITALS)
    return [(*pairs[i % len(pairs)], countries[i % len(countries)]) for i in range(count)]


def steps(system: str, first: str, second: str, country: str) -> list[Step]:
    """The task's three steps, each with the correct calls and results before it."""
    prompt = (
        f"Read the file prices.txt, add the price of {first} and the price of {second}, "
        f"and look up the capital of {country}."
    )
    plan = [
        ("read_file", {"name": "prices.txt"}, FILES["prices.txt"]),
        ("add", {"a": PRICES[first], "b": PRICES[second]}, str(PRICES[first] + PRICES[second])),
        ("capital", {"country": country}, CAPITALS[country]),
    ]
    history: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": prompt},
    ]
    found = []
    for index, (tool, arguments, result) in enumerate(plan):
        found.append(Step(tool, arguments, list(history)))
        call = {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": tool, "arguments": json.dumps(arguments)},
        }
        history += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result},
        ]
    return found


def plain_specs() -> list[dict[str, Any]]:
    """The examples' tools with their bounds removed: strings and integers of any value."""
    specs = json.loads(json.dumps(TOOL_SPECS))
    for spec in specs:
        for prop in spec["function"]["parameters"]["properties"].values():
            for bound in ("enum", "minimum", "maximum"):
                prop.pop(bound, None)
    return specs


def matches_schema(name: str, arguments: dict[str, Any]) -> bool:
    schema = SCHEMAS[name]
    if sorted(arguments) != sorted(schema["required"]):
        return False
    for key, value in arguments.items():
        prop = schema["properties"][key]
        if prop["type"] == "integer":
            if not isinstance(value, int) or not prop["minimum"] <= value <= prop["maximum"]:
                return False
        elif value not in prop["enum"]:
            return False
    return True


def judge(step: Step, reply: Any) -> Counter[str]:
    choice = reply.choices[0]
    outcome: Counter[str] = Counter(runaway=choice.finish_reason == "length")
    calls = choice.message.tool_calls or []
    if not calls:
        return outcome
    outcome["called"] = 1
    call = calls[0].function
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        return outcome
    if call.name in SCHEMAS and isinstance(arguments, dict):
        outcome["valid"] = matches_schema(call.name, arguments)
        outcome["right"] = call.name == step.tool and arguments == step.expected
    return outcome


def ask(
    client: openai.OpenAI, model: str, step: Step, *, choice: str, tools: list[dict[str, Any]]
) -> Counter[str]:
    tool_choice: Any = (
        {"type": "function", "function": {"name": step.tool}} if choice == "named" else choice
    )
    reply = client.chat.completions.create(
        model=model,
        messages=step.messages,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    return judge(step, reply)


def measure(base_url: str, model: str | None, count: int) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="-", timeout=300)
    model = model or client.models.list().data[0].id
    schemas = {"bounded": TOOL_SPECS, "plain": plain_specs()}
    systems = {"few-shot": SYSTEM, "plain": PLAIN_SYSTEM}
    print(f"model {model}, {count} variants x 3 steps per row, greedy, max_tokens {MAX_TOKENS}")
    print(f"{'tool_choice':<12}{'schemas':<9}{'system':<10}  valid   right   runaway   by step")
    for choice, schema_name, system_name in CONDITIONS:
        tools, system = schemas[schema_name], systems[system_name]
        cases = [s for v in variants(count) for s in steps(system, *v)]
        with ThreadPoolExecutor(4) as pool:
            one = functools.partial(ask, client, model, choice=choice, tools=tools)
            outcomes = list(pool.map(one, cases))
        total = sum(outcomes, Counter())
        by_step = " ".join(
            f"{tool} {sum(o['right'] for s, o in zip(cases, outcomes) if s.tool == tool)}"
            for tool in SCHEMAS
        )
        n = len(cases)
        print(
            f"{choice:<12}{schema_name:<9}{system_name:<10}  {total['valid'] / n:5.0%}   "
            f"{total['right'] / n:5.0%}   {total['runaway'] / n:5.0%}     {by_step} (of {count})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint (default: start one)")
    parser.add_argument("--model", help="model name or directory (default: the default model)")
    parser.add_argument("--variants", type=int, default=4)
    args = parser.parse_args()
    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            # One core: on a busy 2-core machine an engine's two OpenMP threads wait on each
            # other at every barrier, and decoding slows to a few tokens per second.
            config = StackConfig(
                model=args.model, prefill=0, decode=1, router=False, port=0, cpu_cores=(0,),
                log_dir=Path(tempfile.mkdtemp(prefix="agentkv-tool-calls-")),
            )  # fmt: skip
            engine = stack.enter_context(Stack(config))
            base_url = f"{engine.endpoint}/v1"
            print(f"engine log: {engine.log_paths}", flush=True)
        measure(base_url, args.model if args.base_url else None, args.variants)


if __name__ == "__main__":
    main()
