"""The engines a self-contained benchmark measures: one prefill and one decode vLLM engine with
agentkv's connector, on this machine's CPU, started with the bundle's launcher.

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
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from agentkv_server.bench.modes import Deployment
from agentkv_server.bundle.launcher import EngineProcess, EngineSpec, Role
from agentkv_server.bundle.model import resolve_model
from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.stack import core_layout
from agentkv_server.wire import ROUTER_URL_ENV, SECRET_ENV

__all__ = ["ENGINE_ARGS", "local_engines"]

HOST = "127.0.0.1"
# Every engine reports prompt-token details (the launcher's default), which gives the aggregated
# mode its prefix-cache hits per request.
ENGINE_ARGS: dict[Role, tuple[str, ...]] = {
    "prefill": ("--no-enable-prefix-caching",),
    "decode": (),
}


@contextlib.contextmanager
def local_engines(
    model: str | None, log_dir: Path, *, timeout_s: float = 600.0
) -> Iterator[tuple[Deployment, Path]]:
    """Start P and D for ``model`` (a preset name or a model directory); yield the deployment
    the modes run on and the model's directory; stop both engines afterwards."""
    model_dir, served = resolve_model(model)
    secret = secrets.token_urlsafe(16)
    router_port, *ports = free_ports(5, HOST)
    report_to = {ROUTER_URL_ENV: f"http://{HOST}:{router_port}", SECRET_ENV: secret}
    cores = core_layout(2, tuple(sorted(os.sched_getaffinity(0))))
    roles: tuple[Role, Role] = ("prefill", "decode")
    engines = [
        EngineProcess(
            EngineSpec(
                role=role,
                model=model_dir,
                served_name=served,
                port=ports[2 * i],
                side_channel_port=ports[2 * i + 1],
                log_path=log_dir / f"{role}.log",
                host=HOST,
                cores=cores[i],
                engine_args=ENGINE_ARGS[role],
                env=report_to,
            )
        )
        for i, role in enumerate(roles)
    ]
    with contextlib.ExitStack() as running:
        for engine in engines:
            running.callback(engine.stop)
            engine.start()
        for engine in engines:
            engine.wait_healthy(timeout_s)
        prefill, decode = (engine.url for engine in engines)
        yield Deployment(served, (prefill,), (decode,), (decode,), router_port, secret), model_dir
