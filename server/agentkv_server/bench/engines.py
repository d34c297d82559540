"""The engines a self-contained benchmark measures: one prefill and one decode vLLM engine with
agentkv's connector, on this machine's CPU, started as a bundle stack without its router.

The prefill engine runs without prefix caching: on one P serving a few sessions, its own cache
would keep every earlier prompt and hide what recomputing costs, which a P shared by many
sessions (production) does not get to keep; vLLM's own bidirectional-transfer result is
measured the same way. The decode engine keeps its prefix cache and doubles as the
``aggregated`` mode's engine (requests without ``kv_transfer_params`` are served as on any
engine), so every mode runs on the same processes and model. Bench runs a router per mode, so
the decode engine reports its holdings to the port those routers take.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from agentkv_server.bench.modes import Deployment
from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.stack import Stack, StackConfig

__all__ = ["PREFILL_ARGS", "local_engines"]

HOST = "127.0.0.1"
# Every engine reports prompt-token details (the launcher's default), which gives the aggregated
# mode its prefix-cache hits per request.
PREFILL_ARGS = ("--no-enable-prefix-caching",)


@contextlib.contextmanager
def local_engines(
    model: str | None, log_dir: Path, *, kv_cache_gib: int = 1, timeout_s: float = 600.0
) -> Iterator[tuple[Deployment, Path]]:
    """Start P and D for ``model`` (a preset name or a model directory); yield the deployment
    the modes run on and the model's directory; stop both engines afterwards."""
    (router_port,) = free_ports(1, HOST)
    config = StackConfig(
        model=model,
        host=HOST,
        log_dir=log_dir,
        prefill_args=PREFILL_ARGS,
        router=False,
        report_port=router_port,
        kv_cache_gib=kv_cache_gib,
    )
    stack = Stack(config).start(timeout_s)
    try:
        assert stack.model_dir is not None
        prefill, decode = stack.prefill[0].url, stack.decode[0].url
        deployment = Deployment(
            model=stack.served_name,
            prefill_urls=(prefill,),
            decode_urls=(decode,),
            aggregated_urls=(decode,),
            router_port=router_port,
            secret=config.secret,
        )
        yield deployment, stack.model_dir
    finally:
        stack.stop()
