"""Drive one prefill and one decode engine by hand, as the router does (docs/protocol.md
section 5), with token-id prompts.

The engine tests use this to look at the KV path itself, with no router policy in between:
token-id prompts make every turn's prompt extend the previous turn's held tokens exactly.
``logprob_gap`` and ``LOGPROB_TOLERANCE`` are the oracle that decides whether reused KV equals
recomputed KV (docs/engines.md).
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentkv_server import wire

__all__ = [
    "LOGPROB_TOLERANCE",
    "DecodeStep",
    "EngineClient",
    "KVProbe",
    "PrefillStep",
    "logprob_gap",
]

# Largest top-k logprob difference (nats) still counted as the same KV on the fp32 test model:
# recomputing in another order moved them by <5e-7, a wrong KV prefix by >0.05 and changed the
# top-5 in every trial (docs/engines.md).
LOGPROB_TOLERANCE = 1e-4

_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
_LOCAL_HITS = "vllm:prefix_cache_hits_total"


class EngineClient:
    """The few calls the probe makes to one vLLM engine (blocking, stdlib only)."""

    def __init__(self, url: str, model: str, *, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout

    def complete(self, prompt: Sequence[int], **body: Any) -> dict[str, Any]:
        """POST /v1/completions with a token-id prompt; the parsed JSON answer."""
        data = json.dumps({"model": self.model, "prompt": list(prompt), **body}).encode()
        request = urllib.request.Request(
            self.url + "/v1/completions", data=data, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.load(response)

    def kv_usage(self) -> float:
        """The share of KV blocks owned by requests (retained ones included, cached free ones
        not), read after one step of a one-token request the engine keeps nothing of: vLLM's
        gauge moves only when the engine steps, so blocks freed since its last step would
        otherwise still count."""
        self.complete([11, 12], max_tokens=1, kv_transfer_params={wire.RETENTION_SECONDS: 0})
        return self.metric("vllm:kv_cache_usage_perc")

    def metric(self, name: str) -> float:
        """A Prometheus counter or gauge from /metrics, summed over its label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + "{", name + " "))
        )


@dataclass(frozen=True)
class PrefillStep:
    """An engine's answer to a one-token step (P's prefill step, or a reference answer)."""

    top_logprobs: dict[str, float]  # of the first generated token
    params: dict[str, Any]  # the engine's kv_transfer_params ({} without): for the decode step
    pulled_tokens: int  # external prefix-cache hits: tokens loaded from a holder
    local_hit_tokens: int  # the engine's own prefix-cache hits
    seconds: float


@dataclass(frozen=True)
class DecodeStep:
    """D's answer to one decode step."""

    token_ids: list[int]
    holding: dict[str, Any]  # D's kv_transfer_params: what the next turn may pull
    seconds: float


class KVProbe:
    """One prefill engine ``p`` and one decode engine ``d`` of the same model."""

    def __init__(self, p: EngineClient, d: EngineClient, *, top_k: int = 5) -> None:
        self.p = p
        self.d = d
        self.top_k = top_k

    def prefill(
        self, prompt: Sequence[int], holding: Mapping[str, Any] | None = None, **body: Any
    ) -> PrefillStep:
        """Step P (``max_tokens=1``); with ``holding`` (D's params), P pulls what it holds."""
        params = wire.pull_prefill_params(holding) if holding else wire.cold_prefill_params()
        return self._first_token_step(self.p, prompt, kv_transfer_params=params, **body)

    def decode_engine_logprobs(self, prompt: Sequence[int]) -> PrefillStep:
        """``prompt`` answered by D alone, from its own prefix cache: the KV that a pull of D's
        holding copies, used by the same code, so a correct pull makes P answer exactly this."""
        return self._first_token_step(self.d, prompt)

    def decode(
        self,
        prompt: Sequence[int],
        prefill: PrefillStep,
        *,
        max_tokens: int = 16,
        retention_seconds: float | None = None,
        release: Sequence[str] = (),
    ) -> DecodeStep:
        """Step D with P's params, asking D to retain the KV ``retention_seconds`` (None: the
        engine's default) and to free the retained requests ``release`` as the step arrives.
        ``ignore_eos`` makes the held token count exactly prompt + max_tokens - 1."""
        params = wire.decode_params(
            prefill.params, retention_s=retention_seconds, ticket=None, release=release
        )
        started = time.perf_counter()
        answer = self.d.complete(
            prompt,
            max_tokens=max_tokens,
            ignore_eos=True,
            return_token_ids=True,
            temperature=0,
            kv_transfer_params=params,
        )
        return DecodeStep(
            answer["choices"][0]["token_ids"],
            answer[wire.KV_TRANSFER_PARAMS],
            time.perf_counter() - started,
        )

    def decode_first_token(self, prompt: Sequence[int], prefill: PrefillStep) -> PrefillStep:
        """D's first token of ``prompt`` after P's step ``prefill``, with its top-k logprobs
        for the oracle and D's params; D retains nothing of it."""
        params = wire.decode_params(prefill.params, retention_s=0, ticket=None)
        return self._first_token_step(self.d, prompt, kv_transfer_params=params)

    def turn(
        self,
        prompt: Sequence[int],
        holding: Mapping[str, Any] | None = None,
        *,
        max_tokens: int = 16,
        retention_seconds: float | None = None,
    ) -> tuple[PrefillStep, DecodeStep]:
        """One whole turn: P (pulling ``holding`` if given), then D."""
        prefill = self.prefill(prompt, holding)
        decode = self.decode(
            prompt, prefill, max_tokens=max_tokens, retention_seconds=retention_seconds
        )
        return prefill, decode

    def judged_body(self, prompt: Sequence[int], output_tokens: int) -> dict[str, Any]:
        """A completion body for a turn sent through a router whose first token is then judged
        against :meth:`recomputed_logprobs`: greedy, exactly ``output_tokens`` tokens (so the
        holding's size is known), the top-k logprobs keyed by token id, the generated ids."""
        return {
            "model": self.p.model,
            "prompt": list(prompt),
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "logprobs": self.top_k,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }

    def recomputed_logprobs(self, prompt: Sequence[int]) -> dict[str, float]:
        """First-token top-k logprobs of ``prompt`` computed from scratch on P:
        ``prompt_logprobs`` makes vLLM skip every cache, local and external."""
        answer = self.p.complete(prompt, prompt_logprobs=0, **self._first_token())
        return answer["choices"][0]["logprobs"]["top_logprobs"][0]

    def _first_token_step(
        self, engine: EngineClient, prompt: Sequence[int], **body: Any
    ) -> PrefillStep:
        pulled, local = engine.metric(_EXTERNAL_HITS), engine.metric(_LOCAL_HITS)
        started = time.perf_counter()
        answer = engine.complete(prompt, **self._first_token(), **body)
        seconds = time.perf_counter() - started
        return PrefillStep(
            top_logprobs=answer["choices"][0]["logprobs"]["top_logprobs"][0],
            params=answer.get(wire.KV_TRANSFER_PARAMS) or {},
            pulled_tokens=round(engine.metric(_EXTERNAL_HITS) - pulled),
            local_hit_tokens=round(engine.metric(_LOCAL_HITS) - local),
            seconds=seconds,
        )

    def _first_token(self) -> dict[str, Any]:
        # Greedy, or the sampled token joins the top-k; token ids as keys, as distinct tokens
        # may decode to the same text.
        return {
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": self.top_k,
            "return_tokens_as_token_ids": True,
        }


def logprob_gap(got: Mapping[str, float], want: Mapping[str, float]) -> float:
    """Largest difference between two top-k logprob maps, counting what a token seen in only
    one map must at least differ by.

    A token missing from a map's top-k had, in that computation, a logprob no higher than the
    map's smallest (k-th) one; so a token only in ``got`` differs from its ``want`` value by at
    least ``got[t] - min(want)``, and the other way round. Two tokens within noise of each other
    at the cut may swap places between a batched and a single computation (a 5th-6th margin
    under 1e-4 in 2 of 300 prompts on the fp32 test model): that is a gap as small as the noise,
    not an infinite one. A wrong KV moves common tokens by >0.05 and reshuffles the top-k, which
    keeps its gap large (docs/engines.md).
    """
    only_got = got.keys() - want.keys()
    only_want = want.keys() - got.keys()
    gaps = [abs(got[token] - want[token]) for token in got.keys() & want.keys()]
    gaps += [got[token] - min(want.values(), default=-math.inf) for token in only_got]
    gaps += [want[token] - min(got.values(), default=-math.inf) for token in only_want]
    return max([0.0, *gaps])
