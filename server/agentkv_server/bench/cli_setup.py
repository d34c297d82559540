"""What every measuring ``agentkv bench`` command needs, whatever its preset: the engines (started
here, given as URLs, or endpoints measured as they are) and each mode's endpoint on them, the
warm-up, an event loop that SIGTERM stops as Ctrl-C does, and what every results.json says about
how it was asked for (bench/cli.py parses the options; bench/sweep_cli.py measures the overload
and agents12 presets).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from agentkv_server.bench.modes import (
    MODES,
    Deployment,
    ModeName,
    ends_sessions,
    parse_base_urls,
    serve_mode,
)
from agentkv_server.bench.runner import Runner, Target
from agentkv_server.bench.workload import Preset, TextTokenizer, Workload, load_tokenizer
from agentkv_server.errors import ConfigError
from agentkv_server.settings import environment_settings

__all__ = [
    "TURN_TIMEOUT_S",
    "OpenTarget",
    "Setup",
    "Stopped",
    "describe_deployment",
    "no_progress",
    "open_deployment",
    "open_setup",
    "progress_line",
    "refuse",
    "run_config",
    "run_until_stopped",
    "timing",
    "warm_up",
]

T = TypeVar("T")

# Long enough a history that the agentkv router pulls it on the later turns.
_WARM_UP = Workload(sessions=1, turns=3, history_tokens=(512,), new_tokens=16, output_tokens=4)
_WARM_UP_VIA: tuple[ModeName, ...] = ("agentkv", "recompute", "aggregated")
# Seconds one turn may take (the mode comparison's; agents12's, as openai's own default).
TURN_TIMEOUT_S = 600.0


class Stopped(Exception):
    """The run's event loop was stopped by SIGTERM."""


def run_until_stopped(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, where SIGTERM cancels ``main`` as asyncio's own handler does on
    Ctrl-C: the routers and probes it opened stop on the way out, before the loop closes (an
    exception raised into the loop instead would cancel a router's requests mid-answer). A
    background job, whose shell ignores SIGINT for it, can still be stopped so."""
    return asyncio.run(_stoppable(main))


async def _stoppable(main: Coroutine[Any, Any, T]) -> T:
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    previous = signal.getsignal(signal.SIGTERM)
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        if task is not None:
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, stop)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
        return await main
    try:
        return await main
    except asyncio.CancelledError:
        if stopped:
            raise Stopped from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)


def refuse(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """ConfigError naming the options of ``names`` that were given, and ``why`` they cannot be."""
    given = [name for name in names if getattr(args, name) not in (None, [])]
    if given:
        options = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(f"{options} {why}")


OpenTarget = Callable[[ModeName], contextlib.AbstractAsyncContextManager[Target]]


@dataclass(frozen=True)
class Setup:
    """What a run measures: the modes, how to open each one's endpoint, and for the report."""

    modes: tuple[ModeName, ...]
    open_target: OpenTarget
    model: str
    tokenizer: TextTokenizer
    description: str
    open_warm_up: OpenTarget | None = None
    """How the warm-up opens its mode, where that differs from ``open_target``."""
    deployment: Deployment | None = None
    """The engines behind the routers bench runs (None: endpoints given as they are)."""


def run_config(args: argparse.Namespace, plan: Preset) -> dict[str, object]:
    """What every results.json says about how it was asked for."""
    return {
        "command": _command_line(),
        "preset": args.preset,
        "workload": json.loads(json.dumps(asdict(plan.workload), default=str)),
        "router_settings": environment_settings(),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def timing(started: float) -> dict[str, object]:
    """When a run started (``time.time()``) and how long it took, for its results.json."""
    return {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
    }


def progress_line(line: str) -> None:
    """A progress line on stderr, with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def no_progress(line: str) -> None:
    """No progress lines (``--no-progress``)."""


async def warm_up(runner: Runner, setup: Setup, salt: str) -> None:
    """One short session before measuring, not recorded: first requests on fresh engines pay
    one-off costs (the first NIXL handshake in each direction among them). It goes through the
    first of ``_WARM_UP_VIA`` measured (``agentkv`` with the ``always`` policy on a router bench
    runs, so that its follow-ups pull): never ``upstream``, whose engines would then retain the
    session's KV for 480 s while the other modes run."""
    mode = next((m for m in _WARM_UP_VIA if m in setup.modes), None)
    if mode is None:
        return
    warm = Runner(_WARM_UP, runner.tokenizer, request_timeout_s=runner.request_timeout_s)
    async with (setup.open_warm_up or setup.open_target)(mode) as target:
        await warm.run(target, repeat=-1, salt=f"warm-{salt}")


@contextlib.contextmanager
def open_setup(args: argparse.Namespace, plan: Preset, out_dir: Path) -> Iterator[Setup]:
    """The modes' endpoints for as long as the block runs: the endpoints given (``--base-url``),
    or a router per mode in front of the engines (started here, or given)."""
    if args.base_url:
        yield _given_endpoints(args)
        return
    with open_deployment(args, plan, out_dir) as (deployment, tokenizer, _):

        def routed(mode: ModeName) -> contextlib.AbstractAsyncContextManager[Target]:
            return serve_mode(mode, deployment)

        description = describe_deployment(deployment)

        def warming(mode: ModeName) -> contextlib.AbstractAsyncContextManager[Target]:
            # agentkv's own policy continues short follow-ups on the holder, which would leave
            # P's first pull from D (and its handshake) to the measured turns.
            return serve_mode(mode, deployment, policy="always" if mode == "agentkv" else None)

        yield Setup(
            tuple(args.modes), routed, deployment.model, tokenizer, description, warming, deployment
        )


def describe_deployment(deployment: Deployment) -> str:
    """The engines, as a report names them."""
    return (
        f"prefill {list(deployment.prefill_urls)}, decode {list(deployment.decode_urls)}, "
        f"aggregated {list(deployment.aggregated_urls)}"
    )


def _given_endpoints(args: argparse.Namespace) -> Setup:
    urls = parse_base_urls(args.base_url, tuple(args.modes))
    model = args.model or _served_model(next(iter(urls.values()))[0])

    @contextlib.asynccontextmanager
    async def given(mode: ModeName) -> AsyncIterator[Target]:
        yield Target(
            mode,
            urls[mode],
            model,
            tuple(args.metrics_url),
            tag_body=mode != "aggregated",
            ends_sessions=ends_sessions(mode),
        )

    modes = tuple(mode for mode in args.modes if mode in urls)
    return Setup(modes, given, model, load_tokenizer(args.tokenizer), f"running endpoints {urls}")


@contextlib.contextmanager
def open_deployment(
    args: argparse.Namespace, plan: Preset, out_dir: Path
) -> Iterator[tuple[Deployment, TextTokenizer, Path | None]]:
    """The engines (started here unless given), the tokenizer that sizes prompts, and the
    model's directory where it is known (the local stack's, or ``--tokenizer``'s)."""
    tuned = environment_settings()  # the AGENTKV_* settings, for the modes' routers and D
    if args.decode_url:
        if not args.secret:
            raise ConfigError("--decode-url needs --secret (the engines' agentkv_secret)")
        model = args.model or _served_model(args.decode_url[0])
        yield (
            Deployment(
                model=model,
                prefill_urls=tuple(args.prefill_url),
                decode_urls=tuple(args.decode_url),
                aggregated_urls=tuple(args.aggregated_url or args.decode_url),
                router_port=args.router_port,
                secret=args.secret,
                router_settings=tuned,
            ),
            load_tokenizer(args.tokenizer),
            args.tokenizer if args.tokenizer is not None and args.tokenizer.is_dir() else None,
        )
        return
    from agentkv_server.bench.engines import local_engines
    from agentkv_server.bundle.model import min_kv_cache_gib

    model = args.model or plan.model
    # A long-context test model gets more KV cache than asked for (StackConfig).
    kv_cache_gib = max(plan.kv_cache_gib, min_kv_cache_gib(model))
    decode_kv = "" if plan.decode_kv_tokens is None else f", decode {plan.decode_kv_tokens} tokens"
    host_tier = f", {args.host_tier_gib:g} GiB host tier below D" if args.host_tier_gib else ""
    print(
        f"starting a prefill and a decode engine ({model}, {kv_cache_gib} GiB of KV cache "
        f"each{decode_kv}{host_tier}); logs in {out_dir}",
        file=sys.stderr,
    )
    engines = local_engines(
        model,
        out_dir,
        kv_cache_gib=plan.kv_cache_gib,
        decode_kv_tokens=plan.decode_kv_tokens,
        host_tier_gib=args.host_tier_gib or 0.0,
        aggregated="aggregated" in (args.modes or MODES),
        router_settings=tuned,
        prefill_prefix_cache=plan.prefill_prefix_cache,
    )
    with engines as (deployment, model_dir):
        yield deployment, load_tokenizer(args.tokenizer or model_dir), model_dir


def _served_model(url: str) -> str:
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"cannot ask {url} for its model ({exc}); pass --model") from None


def _command_line() -> str:
    """The command as typed, when this process is ``agentkv bench ...``."""
    args = sys.argv[1:]
    return shlex.join(["agentkv", *args]) if args[:1] == ["bench"] else "agentkv bench"
