"""agentkv across hosts (network namespaces; ``cluster`` is conftest.py's Cluster): a session's turns reuse KV through
either router replica, and a decode host cut off mid-session costs a recompute, not the turn."""

from __future__ import annotations

import random
import subprocess
import time
from typing import Any

import pytest

from agentkv_server.testing.netns import Network, our_leftovers

pytestmark = [pytest.mark.engine, pytest.mark.multihost, pytest.mark.redis]

PULLED = "vllm:external_prefix_cache_hits_total"
FINISHED = "vllm:request_success_total"
# The router gives up a pull after its pull timeout (30 s) and recomputes; a turn that takes
# much longer than that has hung on the cut host.
CUT_TURN_BOUND_S = 60.0


def tokens(seed: int, n: int) -> list[int]:
    """Token ids no other test produces, so that a prefix is only ever held by this test's turns."""
    rng = random.Random(f"{__name__}:{seed}")
    return [rng.randrange(10, 4000) for _ in range(n)]


def tcp_peers(cluster: Any, host: str) -> set[tuple[str, int]]:
    """(peer address, local port) of the established TCP connections inside ``host``."""
    lines = subprocess.run(
        cluster.host(host).command("ss", "-tnH", "state", "established"),
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    peers = set()
    for line in lines:
        local, peer = line.split()[-2:]
        peers.add((peer.rsplit(":", 1)[0], int(local.rsplit(":", 1)[1])))
    return peers


def test_a_session_reuses_kv_across_hosts_through_both_replicas(cluster: Any) -> None:
    router_a, router_b = cluster.routers
    prompt = tokens(1, 700)
    with cluster.agent(f"multihost-{time.time_ns()}") as agent:
        first = agent.turn(router_a, prompt)
        pulled_before = cluster.prefill.metric(PULLED)
        second = agent.turn(router_b, prompt + first["token_ids"] + tokens(2, 60))
        pulled = cluster.prefill.metric(PULLED) - pulled_before
    assert first["kv_path"] == "recompute"
    assert second["kv_path"] == "reuse", second
    assert second["reused_tokens"] > 0
    assert pulled > 0  # P loaded the held KV from the decode host, over the link
    decode_addresses = {cluster.host(name).address for name in cluster.decode}
    ucx = {
        (peer, port)
        for peer, port in tcp_peers(cluster, "prefill")
        if peer in decode_addresses and port != 8100
    }
    assert ucx, "no TCP connection from the prefill host to a decode host but HTTP"


def test_a_cut_off_decode_host_costs_a_recompute_not_the_turn(cluster: Any) -> None:
    router_a, router_b = cluster.routers
    prompt = tokens(3, 700)
    with cluster.agent(f"multihost-cut-{time.time_ns()}") as agent:
        finished = {name: engine.metric(FINISHED) for name, engine in cluster.decode.items()}
        first = agent.turn(router_a, prompt)
        (holder,) = [n for n, e in cluster.decode.items() if e.metric(FINISHED) > finished[n]]
        prompt = prompt + first["token_ids"] + tokens(4, 60)
        cluster.network.cut(cluster.host(holder))
        try:
            second = agent.turn(router_b, prompt)
        finally:
            cluster.network.restore(cluster.host(holder))
        third = agent.turn(router_a, prompt + second["token_ids"] + tokens(5, 60))
    assert second["kv_path"] in ("recompute", "fallback"), second
    assert second["seconds"] < CUT_TURN_BOUND_S
    assert len(second["token_ids"]) > 0
    assert len(third["token_ids"]) > 0


def test_hosts_are_torn_down_even_when_a_test_fails() -> None:
    """A failure inside the network still deletes every namespace and link (the cluster's own
    teardown asserts the same when the module ends)."""
    with pytest.raises(RuntimeError, match="inside"), Network("10.77.1.0/24") as network:
        network.add("one")
        network.add("two")
        assert len(our_leftovers(network.tag + "-")[0]) == 2
        raise RuntimeError("a failure inside")
    assert our_leftovers(network.tag + "-") == ([], [])
