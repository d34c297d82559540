#!/usr/bin/env python
"""How often does the served model make a usable tool call on the examples' task?

Runs the examples' task (examples/_common.py: read a file, look up the capital of the country it
names, add two numbers the user gives, answer) over ``--variants`` seeded variants (another
file, country and numbers each), every step with the right history before it, under each
condition of ``--conditions``:

  tool_choice  named (the step's tool), required (any tool), auto (the model decides);
  schemas      bounded (enum file names and countries, numbers 0-999) or plain (type only);
  system       few-shot (the examples' system prompt: one worked task) or plain.

Per condition: *parsed*, a call came back; *right tool*, it was the step's tool; *right args*,
that tool with the step's arguments; *runaway*, the answer was cut at max_tokens. The row
``answer`` is the examples' last turn (``tool_choice: none`` and their structured answer
format, after all three results): *parsed* when it is the answer's JSON, *right* when it holds
the right country, capital and total. Greedy decoding, so one run per variant says it all.

    flock /tmp/agentkv-engines.lock timeout 900 .venv/bin/python scripts/measure_tool_calls.py
    .venv/bin/python scripts/measure_tool_calls.py --base-url http://127.0.0.1:8000/v1

Without ``--base-url`` it starts one engine of ``--model`` (default: the real default model).
With ``--offline`` it starts none (no engine lock needed; slow, one call at a time): transformers
decodes under the grammar vLLM would use (scripts/offline_chat.py).

    .venv/bin/python scripts/measure_tool_calls.py --offline --conditions named,answer
"""

from __future__ import annotations

import argparse
import functools
import json
import random
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

from _common import ANSWER_FORMAT, CAPITALS, FILE_NAMES, SYSTEM, TOOL_SPECS, Task

from agentkv_server.bundle.model import resolve_model
from agentkv_server.bundle.stack import Stack, StackConfig

PLAIN_SYSTEM = "You are a helpful assistant with tools."
CONDITIONS = {  # name: (tool_choice, schemas, system)
    "named": ("named", "bounded", "few-shot"),
    "named-plain-schemas": ("named", "plain", "few-shot"),
    "named-plain-system": ("named", "bounded", "plain"),
    "required": ("required", "bounded", "few-shot"),
    "required-plain-system": ("required", "bounded", "plain"),
    "auto": ("auto", "bounded", "few-shot"),
    "answer": ("none", "bounded", "few-shot"),
}
DEFAULT_CONDITIONS = "named,required,auto,answer"
MAX_TOKENS = 48


@dataclass(frozen=True)
class Step:
    tool: str  # "" for the answer turn
    expected: dict[str, Any]
    messages: list[dict[str, Any]]


def variants(count: int, seed: int = 0) -> list[Task]:
    """Seeded tasks: any file, any country of the table, numbers the schema allows."""
    rng = random.Random(seed)
    countries = sorted(CAPITALS)
    return [
        Task(rng.choice(FILE_NAMES), rng.choice(countries), rng.randrange(10, 500),
             rng.randrange(10, 500))
        for _ in range(count)
    ]  # fmt: skip


def steps(system: str, task: Task) -> list[Step]:
    """The task's three tool steps and its answer turn, each with the right history before it."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": task.prompt},
    ]
    found = []
    for index, (tool, arguments, result) in enumerate(task.plan()):
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
    return [*found, Step("", task.answer(), history)]


def plain_specs() -> list[dict[str, Any]]:
    """The examples' tools with their bounds removed: strings and integers of any value."""
    specs = json.loads(json.dumps(TOOL_SPECS))
    for spec in specs:
        for prop in spec["function"]["parameters"]["properties"].values():
            for bound in ("enum", "minimum", "maximum"):
                prop.pop(bound, None)
    return specs


def judge_call(step: Step, reply: Any) -> Counter[str]:
    choice = reply.choices[0]
    outcome: Counter[str] = Counter(runaway=choice.finish_reason == "length")
    calls = choice.message.tool_calls or []
    if not calls:
        return outcome
    call = calls[0].function
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        return outcome
    outcome["parsed"] = 1
    outcome["tool"] = call.name == step.tool
    outcome["args"] = call.name == step.tool and arguments == step.expected
    return outcome


def judge_answer(step: Step, reply: Any) -> Counter[str]:
    choice = reply.choices[0]
    outcome: Counter[str] = Counter(runaway=choice.finish_reason == "length")
    try:
        answer = json.loads(choice.message.content or "")
    except json.JSONDecodeError:
        return outcome
    outcome["parsed"] = 1
    outcome["tool"] = not choice.message.tool_calls
    outcome["args"] = answer == step.expected
    return outcome


def ask(
    client: openai.OpenAI, model: str, step: Step, *, choice: str, tools: list[dict[str, Any]]
) -> Counter[str]:
    if not step.tool:  # the answer turn, as the examples ask for it
        reply = client.chat.completions.create(
            model=model, messages=step.messages, tools=tools, tool_choice="none",
            response_format=ANSWER_FORMAT, max_tokens=MAX_TOKENS, temperature=0,
        )  # fmt: skip
        return judge_answer(step, reply)
    tool_choice: Any = (
        {"type": "function", "function": {"name": step.tool}} if choice == "named" else choice
    )
    reply = client.chat.completions.create(
        model=model, messages=step.messages, tools=tools, tool_choice=tool_choice,
        max_tokens=MAX_TOKENS, temperature=0,
    )  # fmt: skip
    return judge_call(step, reply)


def measure(client: Any, model: str, count: int, conditions: list[str], threads: int) -> None:
    schemas = {"bounded": TOOL_SPECS, "plain": plain_specs()}
    systems = {"few-shot": SYSTEM, "plain": PLAIN_SYSTEM}
    print(f"model {model}, {count} variants per row, greedy, max_tokens {MAX_TOKENS}")
    print(
        f"{'condition':<22}{'calls':>6}  parsed  right tool  right args  runaway   right args by step"
    )
    for name in conditions:
        choice, schema_name, system_name = CONDITIONS[name]
        tools, system = schemas[schema_name], systems[system_name]
        every = [s for task in variants(count) for s in steps(system, task)]
        cases = [s for s in every if (choice == "none") == (not s.tool)]
        with ThreadPoolExecutor(threads) as pool:
            one = functools.partial(ask, client, model, choice=choice, tools=tools)
            outcomes = list(pool.map(one, cases))
        total, n = sum(outcomes, Counter()), len(cases)
        by_step = " ".join(
            f"{tool or 'answer'} {sum(o['args'] for s, o in zip(cases, outcomes) if s.tool == tool)}"
            for tool in dict.fromkeys(s.tool for s in cases)
        )
        print(
            f"{name:<22}{n:>6}  {total['parsed'] / n:6.0%}  {total['tool'] / n:10.0%}  "
            f"{total['args'] / n:10.0%}  {total['runaway'] / n:7.0%}   {by_step} (of {count})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint (default: start one)")
    parser.add_argument("--model", help="model name or directory (default: the default model)")
    parser.add_argument("--variants", type=int, default=20)
    parser.add_argument(
        "--offline", action="store_true", help="no engine: transformers under vLLM's grammar"
    )
    parser.add_argument(
        "--conditions", default=DEFAULT_CONDITIONS,
        help=f"comma-separated, of: {', '.join(CONDITIONS)} (default {DEFAULT_CONDITIONS})",
    )  # fmt: skip
    args = parser.parse_args()
    conditions = args.conditions.split(",")
    if unknown := sorted(set(conditions) - set(CONDITIONS)):
        parser.error(f"unknown conditions: {', '.join(unknown)}")
    if args.offline:
        from offline_chat import OfflineChat

        model_dir, served_name = resolve_model(args.model, dtype="float32")
        measure(OfflineChat(model_dir), served_name, args.variants, conditions, threads=1)
        return
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
        client = openai.OpenAI(base_url=base_url, api_key="-", timeout=300)
        model = (args.base_url and args.model) or client.models.list().data[0].id
        measure(client, model, args.variants, conditions, threads=4)


if __name__ == "__main__":
    main()
