"""The multi-turn agent workload: what every benchmarked session sends, turn by turn.

A session starts from an initial history (system prompt and earlier context) and then runs
``turns`` model calls; each call appends the previous answer plus ``new_tokens`` of fresh input
(a tool result or user message), so turn N's prompt extends turn N-1's, as in a real agent
loop. Between calls the session sleeps for a sampled tool latency.

Texts are generated from a seed, independent of the serving mode, so every mode sees prompts of
the same sizes; a per-run salt at the head of each history keeps one mode's prefix cache from
serving another mode's sessions.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol, get_args

from agentkv_server.bench.agents12 import AgentSessions
from agentkv_server.bench.overload import OverloadWorkload
from agentkv_server.bench.pressure import PressureWorkload
from agentkv_server.bundle.model import DEFAULT_MODEL
from agentkv_server.errors import ConfigError

__all__ = [
    "DECODER_PROMPT_TOKENS",
    "PRESETS",
    "FileTokenizer",
    "Measures",
    "Preset",
    "TextTokenizer",
    "ToolLatency",
    "WordTokenizer",
    "Workload",
    "agents_preset",
    "load_tokenizer",
    "overload_preset",
    "pressure_preset",
    "text_of_tokens",
]

# Prompt of a decoding session's requests: short, so that what they cost is their decoding.
DECODER_PROMPT_TOKENS = 64

Distribution = Literal["fixed", "exponential", "lognormal", "uniform"]
# What a preset measures: every serving mode side by side (runner.py), each KV path's cost
# against history length (paths.py), the modes under memory pressure (pressure.py), beyond
# their capacity (overload.py), or issue 48's twelve agent sessions (agents12.py).
Measures = Literal["modes", "paths", "pressure", "overload", "agents12"]
# The modes the overload preset compares unless --modes says otherwise.
OVERLOAD_MODES = ("aggregated", "agentkv", "upstream-best")


@dataclass(frozen=True)
class ToolLatency:
    """Seconds a tool (or a user) takes between two model calls of a session.

    ``fixed``: always ``mean_s``; ``exponential``: mean ``mean_s``; ``lognormal``: median
    ``mean_s`` with shape ``sigma`` (the heavy tail real tools have); ``uniform``: between
    ``mean_s * (1 - spread)`` and ``mean_s * (1 + spread)``.
    """

    kind: Distribution = "fixed"
    mean_s: float = 0.0
    sigma: float = 0.5
    spread: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in get_args(Distribution):
            raise ConfigError(
                f"tool latency kind {self.kind!r} is not one of {get_args(Distribution)}"
            )
        if self.mean_s < 0 or self.sigma < 0 or not 0 <= self.spread <= 1:
            raise ConfigError(f"invalid tool latency {self!r}")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed" or self.mean_s == 0:
            return self.mean_s
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.mean_s)
        if self.kind == "lognormal":
            return rng.lognormvariate(math.log(self.mean_s), self.sigma)
        return rng.uniform(self.mean_s * (1 - self.spread), self.mean_s * (1 + self.spread))

    @classmethod
    def parse(cls, text: str) -> ToolLatency:
        """``KIND:SECONDS`` as the command line writes it, e.g. ``lognormal:1.5`` or ``0.5``."""
        kind, _, seconds = text.rpartition(":")
        try:
            return cls(kind=kind or "fixed", mean_s=float(seconds))  # type: ignore[arg-type]
        except ValueError:
            raise ConfigError(f"tool latency {text!r} is not KIND:SECONDS") from None

    def __str__(self) -> str:
        return f"{self.kind}:{self.mean_s:g}"


@dataclass(frozen=True)
class Workload:
    """Shape of the sessions one benchmark run drives against every mode.

    The whole set of ``sessions`` runs once per initial history length in ``history_tokens``
    (the sweep); at most ``concurrency`` sessions are active at once.

    The concurrency dimension: ``decoders`` more sessions decode long outputs
    (``decode_tokens`` each, one request after another) for as long as the agent sessions of
    a history length run, so that what a turn's prefill does to other sessions' decoding shows
    in their inter-token latency (0: none).
    """

    sessions: int
    turns: int
    history_tokens: tuple[int, ...]
    new_tokens: int
    output_tokens: int
    tool_latency: ToolLatency = ToolLatency()
    concurrency: int = 1
    seed: int = 0
    decoders: int = 0
    decode_tokens: int = 256

    def __post_init__(self) -> None:
        if (
            min(self.sessions, self.turns, self.new_tokens, self.output_tokens, self.concurrency)
            < 1
        ):
            raise ConfigError("sessions, turns, new/output tokens and concurrency must be >= 1")
        if not self.history_tokens or min(self.history_tokens) < 0:
            raise ConfigError("history_tokens needs at least one length >= 0")
        if self.decoders < 0 or self.decode_tokens < 2:
            raise ConfigError("decoders must be >= 0 and decode_tokens >= 2")

    def tool_latencies(self, history: int, session: int) -> list[float]:
        """Sleeps before turns 2..N of one session: the same for every mode."""
        rng = random.Random(f"{self.seed}:tool:{history}:{session}")
        return [self.tool_latency.sample(rng) for _ in range(self.turns - 1)]

    def history_text(self, tokenizer: TextTokenizer, history: int, session: int, salt: str) -> str:
        """The session's initial context: a salt line, then ``history`` tokens of text."""
        rng = random.Random(f"{self.seed}:history:{history}:{session}")
        return f"[{salt} session {session}]\n" + text_of_tokens(tokenizer, history, rng)

    def decoder_text(self, tokenizer: TextTokenizer, index: int, salt: str) -> str:
        """The short prompt of a decoding session's requests (its cost is the decoding)."""
        rng = random.Random(f"{self.seed}:decoder:{index}")
        return f"[{salt} decoder {index}]\n" + text_of_tokens(tokenizer, DECODER_PROMPT_TOKENS, rng)

    def new_text(self, tokenizer: TextTokenizer, history: int, session: int, turn: int) -> str:
        """The fresh input of one turn (turn 1's user request included)."""
        rng = random.Random(f"{self.seed}:new:{history}:{session}:{turn}")
        return text_of_tokens(tokenizer, self.new_tokens, rng)


@dataclass(frozen=True)
class Preset:
    """A named workload plus how often to repeat it and which local model serves it."""

    description: str
    workload: Workload
    repeats: int
    model: str = "tiny"  # the random-weight test model: starts fast, words are noise
    # Each local engine's KV cache: room for what every mode keeps between turns, so that the
    # run compares speed (upstream's fixed 480 s retention fills 1 GiB on the cpu preset).
    kv_cache_gib: int = 1
    # The local decode engine's KV cache in tokens, below what ``kv_cache_gib`` holds (None: all
    # of it): memory pressure at session sizes this machine's CPUs can prefill in minutes.
    decode_kv_tokens: int | None = None
    # ``paths``: the workload's histories, new and output tokens shape bench/paths.py's sweep
    # (one session per history, one turn per KV path); its other fields do not apply.
    measures: Measures = "modes"
    # ``pressure``: the sessions (bench/pressure.py); the workload then only gives their texts.
    pressure: PressureWorkload | None = None
    # ``overload`` and ``agents12``: the sessions, as ``pressure``.
    overload: OverloadWorkload | None = None
    agents: AgentSessions | None = None
    # The modes measured unless --modes says otherwise (None: every mode).
    modes: tuple[str, ...] | None = None
    # The local prefill engine keeps its prefix cache, as ``agentkv serve`` starts it (bench
    # turns it off elsewhere: bench/engines.py says why).
    prefill_prefix_cache: bool = False

    def with_overrides(self, **fields: object) -> Preset:
        """A copy whose workload fields (or ``repeats`` / ``model`` / ``kv_cache_gib`` /
        ``decode_kv_tokens``) are replaced where given."""
        given = {name: value for name, value in fields.items() if value is not None}
        own = {
            name: given.pop(name)
            for name in ("repeats", "model", "kv_cache_gib", "decode_kv_tokens")
            if name in given
        }
        return replace(self, workload=replace(self.workload, **given), **own)


def pressure_preset(
    description: str,
    pressure: PressureWorkload,
    *,
    repeats: int = 1,
    model: str = DEFAULT_MODEL,
    kv_cache_gib: int = 1,
    decode_kv_tokens: int | None = None,
) -> Preset:
    """A pressure sweep's preset: the texts its sessions send follow the sweep's sizes."""
    most = max(pressure.session_counts)
    texts = Workload(
        sessions=most,
        turns=pressure.turns[1],
        history_tokens=(pressure.history_tokens[1],),
        new_tokens=pressure.new_tokens,
        output_tokens=pressure.output_tokens,
        concurrency=most,
        seed=pressure.seed,
    )
    return Preset(
        description, texts, repeats, model, kv_cache_gib, decode_kv_tokens, "pressure", pressure
    )


def overload_preset(description: str, overload: OverloadWorkload, *, repeats: int = 1) -> Preset:
    """The overload preset on the real model: the texts its sessions send follow its sizes."""
    texts = Workload(
        sessions=1,
        turns=overload.turns[1],
        history_tokens=(overload.history_tokens[1],),
        new_tokens=overload.new_tokens,
        output_tokens=overload.output_tokens,
        seed=overload.seed,
    )
    return Preset(
        description, texts, repeats, DEFAULT_MODEL, measures="overload", overload=overload,
        modes=OVERLOAD_MODES,
    )  # fmt: skip


def agents_preset(description: str, agents: AgentSessions, *, repeats: int = 1) -> Preset:
    """Issue 48's sessions on the engines ``agentkv serve`` starts with its defaults (the real
    model, 1 GiB of KV cache each, the prefill engine's prefix cache on); ``agentkv`` alone
    unless --modes says otherwise."""
    texts = Workload(
        sessions=agents.sessions,
        turns=agents.turns,
        history_tokens=(agents.history_tokens,),
        new_tokens=agents.new_words,
        output_tokens=agents.output_tokens,
        concurrency=agents.sessions,
        seed=agents.seed,
    )
    return Preset(
        description, texts, repeats, DEFAULT_MODEL, measures="agents12", agents=agents,
        modes=("agentkv",), prefill_prefix_cache=True,
    )  # fmt: skip


PRESETS: dict[str, Preset] = {
    "quick": Preset(
        "smoke test: a few short sessions on the tiny random-weight test model, minutes on 2 "
        "CPU cores",
        Workload(
            sessions=2,
            turns=3,
            history_tokens=(256, 1024),
            new_tokens=32,
            output_tokens=8,
            tool_latency=ToolLatency("fixed", 0.2),
            concurrency=2,
        ),
        repeats=1,
    ),
    "cpu": Preset(
        "the full CPU run behind docs/benchmarks.md: the real default model (SmolLM2-135M)",
        Workload(
            sessions=2,
            turns=4,
            history_tokens=(1000, 4000),
            new_tokens=150,
            output_tokens=32,
            tool_latency=ToolLatency("lognormal", 1.0),
            concurrency=1,
        ),
        repeats=2,
        model=DEFAULT_MODEL,
        kv_cache_gib=4,
    ),
    "vllm": Preset(
        "shaped like vLLM's published multi-turn result: 10 conversations x 10 turns, 150 new "
        "and 300 output tokens per turn, sweep of initial history (for GPU engines)",
        Workload(
            sessions=10,
            turns=10,
            history_tokens=(2000, 8000, 16000, 24000),
            new_tokens=150,
            output_tokens=300,
            tool_latency=ToolLatency("lognormal", 1.0),
            concurrency=10,
        ),
        repeats=3,
    ),
    "long": Preset(
        "each KV path's cost against history length, to 128k tokens: one session per history, "
        "one turn per path (recompute, local, pull, recompute) on the tiny-long model; about "
        "13 min on 2 CPU cores",
        Workload(
            sessions=1,
            turns=4,
            history_tokens=(8000, 32000, 64000, 128000),
            new_tokens=112,  # with the 16-token answer, each follow-up adds one 128-token block
            output_tokens=16,
        ),
        repeats=1,
        model="tiny-long",  # the tiny test model with a 131,072-token context
        measures="paths",
    ),
    "pressure": pressure_preset(
        "memory pressure: 4, 6 and 8 sessions at once of the real model (SmolLM2-135M), "
        "600-1800 tokens of history each, on a decode engine with 8,192 tokens of KV; heavy-"
        "tailed tool gaps, a quarter of the sessions go idle without ending; reuse beside the "
        "clairvoyant's (about 20 min on 2 CPU cores for three modes)",
        PressureWorkload(
            session_counts=(4, 6, 8),
            history_tokens=(600, 1800),
            turns=(3, 5),
            new_tokens=150,
            output_tokens=32,
            start_spread_s=60.0,
        ),
        decode_kv_tokens=8192,
    ),
    "overload": overload_preset(
        "bursts of new sessions beside running ones at 1x, 2x and 4x the stack's measured "
        "capacity, and the steady tenant alone, on the real model (SmolLM2-135M): goodput, "
        "refusals, follow-up TTFT, issue 48's bars pass/fail (aggregated, agentkv and "
        "upstream-best; about 50 min on 2 CPU cores)",
        OverloadWorkload(),
    ),
    "agents12": agents_preset(
        "issue 48's run: 12 streamed agent sessions (2.7k-token histories, 5 turns of 100 new "
        "words, 16 output tokens, fast / slow / idle tool gaps, started 3 s apart) on the "
        "engines agentkv serve starts, clients retrying as openai's do (agentkv; about 5 "
        "min)",
        AgentSessions(),
    ),
}


class TextTokenizer(Protocol):
    """What workload generation needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


_WORDS = [
    "the",
    "agent",
    "called",
    "a",
    "tool",
    "and",
    "read",
    "the",
    "result",
    "before",
    "it",
    "wrote",
    "the",
    "next",
    "step",
    "of",
    "its",
    "plan",
    "search",
    "file",
    "list",
    "open",
    "query",
    "price",
    "order",
    "status",
    "weather",
    "city",
    "record",
    "value",
    "table",
    "report",
    "user",
    "asked",
    "for",
    "more",
    "detail",
    "about",
    "each",
    "item",
    "so",
    "the",
    "model",
    "checked",
    "again",
    "with",
    "new",
    "data",
    "error",
    "retry",
    "success",
    "json",
    "field",
    "name",
    "id",
    "date",
    "time",
    "count",
    "total",
    "page",
    "next",
    "previous",
    "summary",
]
_WORD_IDS = {word: index for index, word in enumerate(dict.fromkeys(_WORDS))}
_ID_WORDS = list(_WORD_IDS)


class WordTokenizer:
    """One token per word of the workload's vocabulary: the fallback when the served model's
    tokenizer is not at hand. Common English words are one token in the usual BPE vocabularies,
    so sizes stay close; measured prompt sizes always come from the engines' usage figures."""

    def encode(self, text: str) -> list[int]:
        return [_WORD_IDS[word] for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(_ID_WORDS[i] for i in ids)


class FileTokenizer:
    """The served model's own tokenizer, from its ``tokenizer.json``."""

    def __init__(self, file: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def load_tokenizer(path: Path | None) -> TextTokenizer:
    """The tokenizer in ``path`` (a model directory or a tokenizer.json), else WordTokenizer."""
    if path is None:
        return WordTokenizer()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no tokenizer.json at {path}")
    return FileTokenizer(file)


def text_of_tokens(tokenizer: TextTokenizer, tokens: int, rng: random.Random) -> str:
    """Seeded prose that ``tokenizer`` encodes to ``tokens`` tokens (give or take a merge at
    the cut, which byte-level BPE can make when the text is encoded again)."""
    if tokens == 0:
        return ""
    words = [rng.choice(_WORDS) for _ in range(tokens)]
    while True:
        ids = tokenizer.encode(" ".join(words))
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens])
        words += [rng.choice(_WORDS) for _ in range(tokens - len(ids) + 1)]
