"""``python -m agentkv_server.testing``: serve stub engines until interrupted (for load tests).

Prints the engines' URLs as one JSON line once they listen.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from agentkv_server.testing.stub_engine import StubCluster, http_reporter

try:  # the stubs serve load tests beside the router: the faster event loop, where there is one
    from uvloop import run as run_loop
except ImportError:  # pragma: no cover - a platform without uvloop
    from asyncio import run as run_loop


async def serve(
    count: int, router_url: str | None, secret: str, prefill_us: float, record: bool
) -> None:
    reporter, close = http_reporter(router_url, secret) if router_url else (None, None)
    cluster = StubCluster(reporter=reporter, prefill_s_per_token=prefill_us / 1e6)
    try:
        engines = [await cluster.start(record=record) for _ in range(count)]
        print(json.dumps([engine.url for engine in engines]), flush=True)
        await asyncio.Event().wait()
    finally:
        await cluster.close()
        if close is not None:
            await close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m agentkv_server.testing", description=__doc__)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--router-url", help="where ticketed requests report their holdings")
    parser.add_argument("--secret", default="", help="the router's x-agentkv-secret")
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="the stub model's prefill cost (pulls are free)",
    )
    parser.add_argument(
        "--no-record",
        dest="record",
        action="store_false",
        help="keep no request for assertions (long load runs: memory stays flat)",
    )
    args = parser.parse_args()
    try:
        run_loop(
            serve(
                args.engines, args.router_url, args.secret, args.prefill_us_per_token, args.record
            )
        )
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
