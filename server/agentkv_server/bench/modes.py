"""The five serving modes and how each is put in front of the engines.

- ``recompute``: the router with the always-recompute policy before the P/D engines;
- ``upstream``: the router imitating vLLM's example proxy (64-token threshold, engines' fixed
  480 s retention, no client hints; like that proxy, it learns a holding only from non-streamed
  responses, so a streaming agent gets no reuse from it);
- ``upstream-best``: the same proxy at its best, as it will be once streamed turns report their
  params: it reuses streamed turns too (still no hints: the session's end is not announced);
  like the proxy, both send every turn to the engines at once (the router's admission off);
- ``agentkv``: the router with the cost model, client hints and early release;
- ``aggregated``: no router; sessions go straight to one engine with prefix caching (several
  engines: each session sticks to one, chosen on the client).

The four router modes share the same prefill and decode engines: each gets its own router,
started in this process on the same port (the engines report holdings to that one URL) and
stopped before the next mode starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import uvicorn

from agentkv_server.bench.runner import Target
from agentkv_server.errors import ConfigError
from agentkv_server.router.app import create_app
from agentkv_server.settings import PolicyName, Settings

__all__ = [
    "BASELINE",
    "MODES",
    "Deployment",
    "ModeName",
    "ends_sessions",
    "mode_settings",
    "parse_base_urls",
    "serve_mode",
    "serve_router",
]

ModeName = Literal["recompute", "upstream", "upstream-best", "agentkv", "aggregated"]
# Measured in this order: modes that leave KV retained on the decode engine come last, so that
# they cannot slow the others down (upstream-best keeps each session's last turn 480 s, upstream
# every turn).
MODES: Final[tuple[ModeName, ...]] = (
    "aggregated",
    "recompute",
    "agentkv",
    "upstream-best",
    "upstream",
)
BASELINE: Final[ModeName] = "recompute"

# How long a stopping router waits for requests still in flight (a run cut short by Ctrl-C).
_SHUTDOWN_S: Final = 5

_POLICY: Final[Mapping[str, PolicyName]] = {
    "recompute": "never",
    "upstream": "upstream",
    "upstream-best": "upstream-best",
    "agentkv": "agentkv",
}
# Modes whose clients send no session-end hint: vLLM's proxy has none, and the router would
# release the last turn's KV on it (upstream's policy releases nothing either way).
_NO_SESSION_END: Final[frozenset[str]] = frozenset({"upstream", "upstream-best"})
# Modes that imitate vLLM's proxy, which sends every turn to its engines at once: the router
# holds nothing back and refuses nothing for them (docs/router.md, "Admission").
_NO_ADMISSION: Final[frozenset[str]] = frozenset({"upstream", "upstream-best"})


@dataclass(frozen=True)
class Deployment:
    """Engines the router modes and the aggregated mode use, and where the router listens.

    ``secret`` must be the one the decode engines' connectors send with their holding reports
    (``agentkv_secret``), and ``router_port`` the port of their ``agentkv_router_url``.
    """

    model: str
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    aggregated_urls: tuple[str, ...]
    router_port: int
    secret: str
    router_host: str = "127.0.0.1"
    router_settings: Mapping[str, Any] = field(default_factory=dict)
    """Settings fields for every mode's router beyond those bench sets (the ``AGENTKV_*``
    variables, as ``agentkv router`` reads them)."""

    def metrics_urls(self, mode: str) -> tuple[str, ...]:
        engines = self.aggregated_urls if mode == "aggregated" else self.decode_urls
        return tuple(f"{url.rstrip('/')}/metrics" for url in engines)


def ends_sessions(mode: str) -> bool:
    """Whether ``mode``'s clients tell the router when a session ends."""
    return mode not in _NO_SESSION_END


@contextlib.asynccontextmanager
async def serve_mode(
    mode: ModeName, deployment: Deployment, *, policy: PolicyName | None = None
) -> AsyncIterator[Target]:
    """Set ``mode`` up in front of the deployment's engines for as long as the block runs;
    ``policy`` replaces the mode's router policy (the warm-up pulls with ``always``)."""
    metrics = deployment.metrics_urls(mode)
    if mode == "aggregated":
        if not deployment.aggregated_urls:
            raise ConfigError("mode 'aggregated' needs an engine (--aggregated-url)")
        yield Target(mode, deployment.aggregated_urls, deployment.model, metrics, tag_body=False)
        return
    settings = mode_settings(mode, deployment, policy=policy)
    async with serve_router(settings) as url:
        yield Target(
            mode,
            (url,),
            deployment.model,
            metrics,
            prefill_metrics_urls=tuple(f"{u.rstrip('/')}/metrics" for u in deployment.prefill_urls),
            ends_sessions=ends_sessions(mode),
        )


def mode_settings(
    mode: ModeName, deployment: Deployment, *, policy: PolicyName | None = None
) -> Settings:
    """The router settings of a router mode: the deployment's, then bench's own (its engines,
    the mode's policy), with admission off for the modes that imitate vLLM's proxy."""
    router_settings = dict(deployment.router_settings)
    if mode in _NO_ADMISSION:
        router_settings["admission"] = {**router_settings.get("admission", {}), "enabled": False}
    return Settings.model_validate(
        {
            **router_settings,
            "host": deployment.router_host,
            "port": deployment.router_port,
            "prefill_urls": deployment.prefill_urls,
            "decode_urls": deployment.decode_urls,
            "policy": policy or _POLICY[mode],
            "secret": deployment.secret,
        }
    )


@contextlib.asynccontextmanager
async def serve_router(settings: Settings) -> AsyncIterator[str]:
    """Run a router app on ``settings.host:settings.port`` (0: any free port) in this event
    loop; yields its URL and stops it (lifespan included) when the block ends."""
    listener = socket.create_server((settings.host, settings.port))
    host, port = listener.getsockname()[:2]
    config = uvicorn.Config(
        create_app(settings),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=_SHUTDOWN_S,
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        while not server.started:
            if task.done():
                task.result()  # the router failed to start: raise its error here
                raise ConfigError("the router exited during start-up")
            await asyncio.sleep(0.05)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await _stopped(task)
        listener.close()


async def _stopped(task: asyncio.Task[None]) -> None:
    """Wait for the router's server to shut down, even when the run is stopped meanwhile:
    cancelled there, this wait would leave the server's lifespan to be cancelled as the loop
    closes, which logs its traceback (seen once, in a fresh-clone run of the suite: SIGTERM to a
    background bench: tests/unit/bench/test_interrupt.py)."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task  # bounded by the server's graceful-shutdown timeout
        raise


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside bench's event loop, where signals are bench's: Ctrl-C stops the
    whole run. (uvicorn's own handler would stop only this router, fail the turns in flight and
    let the run go on.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def parse_base_urls(values: list[str], modes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """``--base-url [MODE=]URL`` options as mode -> URLs (several for one mode: session
    affinity on the client). A bare URL belongs to the one mode asked for with ``--modes``."""
    targets: dict[str, list[str]] = {}
    for value in values:
        mode, sep, url = value.partition("=")
        if not sep or "://" in mode:
            if len(modes) != 1:
                raise ConfigError(
                    f"--base-url {value!r}: write MODE=URL when measuring {len(modes)} modes"
                )
            mode, url = modes[0], value
        if mode not in _POLICY and mode != "aggregated":
            raise ConfigError(f"--base-url {value!r}: unknown mode {mode!r}")
        targets.setdefault(mode, []).append(url.rstrip("/"))
    return {mode: tuple(urls) for mode, urls in targets.items()}
