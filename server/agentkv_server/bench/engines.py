"""The engines a self-contained benchmark measures: one prefill and one decode vLLM engine with
agentkv's connector, on this machine's CPU, started as a bundle stack without its router.

The prefill engine runs without prefix caching: on one P serving a few sessions, its own cache
would keep every earlier prompt and hide what recomputing costs, which a P shared by many
sessions (production) does not get to keep; vLLM's own bidirectional-transfer result is
measured the same way. The decode engine keeps its prefix cache and, unless it slices
prefills for agentkv's local path (LocalPathSettings.slice_tokens), doubles as the
``aggregated`` mode's engine (requests without ``kv_transfer_params`` are served as on any
engine). A slicing decode engine would slice aggregated turns too, which vLLM does not do by
default: ``aggregated`` then gets an engine of its own, started as vLLM's defaults serve, on
the decode engine's cores (it idles while the other modes run). Bench runs a router per mode,
so the decode engine reports its holdings to the port those routers take.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agentkv_server.bench.modes import Deployment
from agentkv_server.bundle.launcher import EngineProcess
from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.stack import Stack, StackConfig

__all__ = ["KV_BLOCK_TOKENS", "PREFILL_ARGS", "aggregated_twin", "decode_kv_args", "local_engines"]

HOST = "127.0.0.1"
# Every engine reports prompt-token details (the launcher's default), which gives the aggregated
# mode its prefix-cache hits per request.
PREFILL_ARGS = ("--no-enable-prefix-caching",)
# vLLM's block size on CPUs, named so that a KV cache given in tokens is whole blocks.
KV_BLOCK_TOKENS = 128


@contextlib.contextmanager
def local_engines(
    model: str | None,
    log_dir: Path,
    *,
    kv_cache_gib: int = 1,
    decode_kv_tokens: int | None = None,
    host_tier_gib: float = 0.0,
    timeout_s: float = 600.0,
    aggregated: bool = True,
    router_settings: Mapping[str, Any] | None = None,
    prefill_prefix_cache: bool = False,
) -> Iterator[tuple[Deployment, Path]]:
    """Start P and D for ``model`` (a preset name or a model directory), and an engine for
    ``aggregated`` where D slices prefills; yield the deployment the modes run on and the
    model's directory; stop every engine afterwards. ``decode_kv_tokens``: D's (and the
    aggregated engine's) KV cache in tokens, rounded up to whole blocks (None: all that
    ``kv_cache_gib`` holds). ``host_tier_gib``: host memory below D's KV cache (StackConfig).
    ``router_settings``: the Settings fields the modes' routers run
    with, of which D takes its prefill slice. ``prefill_prefix_cache``: P keeps its prefix
    cache, as ``agentkv serve`` starts it."""
    router_settings = dict(router_settings or {})
    (router_port,) = free_ports(1, HOST)
    config = StackConfig(
        model=model,
        host=HOST,
        log_dir=log_dir,
        prefill_args=() if prefill_prefix_cache else PREFILL_ARGS,
        decode_args=decode_kv_args(decode_kv_tokens),
        router=False,
        report_port=router_port,
        router_settings=router_settings,
        kv_cache_gib=kv_cache_gib,
        host_tier_gib=host_tier_gib,
    )
    stack = Stack(config).start(timeout_s)
    own: EngineProcess | None = None
    try:
        assert stack.model_dir is not None
        prefill, decode = stack.prefill[0].url, stack.decode[0].url
        if aggregated and config.slice_args:
            own = aggregated_twin(stack.decode[0], len(config.slice_args), log_dir)
            own.start()
            own.wait_healthy(timeout_s)
        deployment = Deployment(
            model=stack.served_name,
            prefill_urls=(prefill,),
            decode_urls=(decode,),
            aggregated_urls=(own.url if own is not None else decode,),
            router_port=router_port,
            secret=config.secret,
            router_settings=router_settings,
        )
        yield deployment, stack.model_dir
    finally:
        if own is not None:
            own.stop()
        stack.stop()


def decode_kv_args(tokens: int | None) -> tuple[str, ...]:
    """vLLM options that give an engine ``tokens`` of KV cache (whole blocks of
    KV_BLOCK_TOKENS), or none for all its memory. vLLM keeps one block aside (its null block)
    and refuses an engine whose usable blocks cannot hold one sequence of the model's length:
    the override counts it."""
    if tokens is None:
        return ()
    blocks = -(-tokens // KV_BLOCK_TOKENS) + 1
    return ("--block-size", str(KV_BLOCK_TOKENS), "--num-gpu-blocks-override", str(blocks))


def aggregated_twin(decode: EngineProcess, slicing_args: int, log_dir: Path) -> EngineProcess:
    """The decode engine's twin without its prefill slicing (its first ``slicing_args``
    options) and holding reports: vLLM as it serves by default, for the ``aggregated`` mode."""
    port, side_channel_port = free_ports(2, HOST)
    spec = dataclasses.replace(
        decode.spec,
        port=port,
        side_channel_port=side_channel_port,
        log_path=log_dir / "aggregated.log",
        engine_args=decode.spec.engine_args[slicing_args:],
        env={},
    )
    return EngineProcess(spec)
