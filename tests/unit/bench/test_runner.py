"""The runner and the modes against the real router app in front of stub engines."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from agentkv_server.bench.modes import Deployment, parse_base_urls, serve_mode
from agentkv_server.bench.pressure import SessionPlan
from agentkv_server.bench.records import TurnRecord
from agentkv_server.bench.runner import Runner, Target, session_name
from agentkv_server.bench.workload import ToolLatency, WordTokenizer, Workload
from agentkv_server.errors import ConfigError
from agentkv_server.testing import StubCluster, StubEngine, http_reporter

MODEL = "stub-model"
SECRET = "bench-test-secret"
WORKLOAD = Workload(
    sessions=2,
    turns=3,
    history_tokens=(400,),
    new_tokens=5,
    output_tokens=4,
    tool_latency=ToolLatency("fixed", 0.01),
    concurrency=2,
)


@pytest.fixture
async def cluster() -> AsyncIterator[StubCluster]:
    cluster = StubCluster(model=MODEL)
    yield cluster
    await cluster.close()


@pytest.fixture
async def deployment(cluster: StubCluster, start_engines: Any) -> Deployment:
    prefill, decode = await start_engines(cluster)
    return Deployment(
        MODEL, (prefill.url,), (decode.url,), (decode.url,), router_port=0, secret=SECRET
    )


async def run_mode(mode: str, deployment: Deployment, cluster: StubCluster) -> list[TurnRecord]:
    seen: list[TurnRecord] = []
    async with serve_mode(mode, deployment) as target:  # type: ignore[arg-type]
        report, close = http_reporter(target.base_urls[0], SECRET)
        cluster.reporter = report
        try:
            run = await Runner(WORKLOAD, WordTokenizer(), on_turn=seen.append).run(target, 0, "t")
            records = run.turns
            await cluster.flush_reports()
        finally:
            await close()
    assert len(seen) == len(records) and set(seen) == set(records)  # in completion order
    return records


def decode_engine(cluster: StubCluster) -> StubEngine:
    return next(e for e in cluster.engines if e.name == "decode")


async def test_agentkv_mode_reuses_the_history_and_frees_it_at_session_end(
    deployment: Deployment, cluster: StubCluster
) -> None:
    records = await run_mode("agentkv", deployment, cluster)
    assert len(records) == WORKLOAD.sessions * WORKLOAD.turns
    assert all(r.ok and r.mode == "agentkv" for r in records)
    assert all(
        r.ttft_s is not None and r.latency_s is not None and r.ttft_s <= r.latency_s
        for r in records
    )
    assert [r.kv_path for r in records if r.turn == 1] == ["recompute"] * 2
    followups = [r for r in records if r.turn > 1]
    # Short follow-ups continue on the holder: no prefill step, the holder's cache reused.
    assert all(r.kv_path == "local" and (r.reused_tokens or 0) > 400 for r in followups)
    assert all(r.prefill_s is None and r.decode_s is not None for r in followups)
    assert all(r.prefill_s is not None and r.plan_s is not None for r in records if r.turn == 1)
    assert decode_engine(cluster).retained == {}  # the last turn asked for no retention


async def test_recompute_mode_never_reuses(deployment: Deployment, cluster: StubCluster) -> None:
    records = await run_mode("recompute", deployment, cluster)
    assert all(r.ok and r.kv_path == "recompute" and r.reused_tokens == 0 for r in records)


async def test_upstream_mode_runs_through_its_policy(
    deployment: Deployment, cluster: StubCluster
) -> None:
    records = await run_mode("upstream", deployment, cluster)
    assert all(r.ok and r.kv_path in {"reuse", "recompute", "fallback"} for r in records)


async def test_aggregated_mode_talks_to_the_engine_without_a_router(
    deployment: Deployment, cluster: StubCluster
) -> None:
    records = await run_mode("aggregated", deployment, cluster)
    assert all(r.ok and r.kv_path is None for r in records)
    sent = decode_engine(cluster).completions()
    assert len(sent) == len(records)
    assert all("agentkv" not in r.body and r.headers.get("x-session-id") for r in sent)
    # each turn extends the previous one: history, then 5 new and 4 output words per turn
    last = max(sent, key=lambda r: len(r.body["messages"]))
    assert [m["role"] for m in last.body["messages"]] == ["system", "user", "assistant"] * 1 + [
        "user",
        "assistant",
        "user",
    ]


async def test_a_failed_turn_ends_its_session(deployment: Deployment, cluster: StubCluster) -> None:
    decode_engine(cluster).faults.append("bad_request")
    records = await run_mode("aggregated", deployment, cluster)
    failed = [r for r in records if not r.ok]
    assert len(failed) == 1 and "400" in (failed[0].error or "")
    survivors = [r for r in records if r.session != failed[0].session]
    assert len(survivors) == WORKLOAD.turns
    assert len(records) == WORKLOAD.turns + 1


def test_session_affinity_is_stable() -> None:
    target = Target("aggregated", ("http://a", "http://b", "http://c"), MODEL)
    chosen = {target.url_for(f"s{i}") for i in range(50)}
    assert chosen == set(target.base_urls)
    assert all(target.url_for(f"s{i}") == target.url_for(f"s{i}") for i in range(50))


def test_base_url_options() -> None:
    assert parse_base_urls(
        ["agentkv=http://r:8000/", "aggregated=http://e1", "aggregated=http://e2"],
        ("agentkv", "aggregated"),
    ) == {"agentkv": ("http://r:8000",), "aggregated": ("http://e1", "http://e2")}
    assert parse_base_urls(["http://r:8000"], ("agentkv",)) == {"agentkv": ("http://r:8000",)}
    with pytest.raises(ConfigError):
        parse_base_urls(["http://r:8000"], ("agentkv", "recompute"))
    with pytest.raises(ConfigError):
        parse_base_urls(["fastest=http://r:8000"], ("agentkv",))


async def test_no_two_modes_or_repeats_share_a_prefix(
    deployment: Deployment, cluster: StubCluster
) -> None:
    engine = decode_engine(cluster)
    runner = Runner(WORKLOAD, WordTokenizer())
    for mode, repeat in (("aggregated", 0), ("aggregated", 1), ("recompute", 0)):
        await runner.run(Target(mode, (engine.url,), MODEL, tag_body=False), repeat, "same-run")
    first_lines = {r.body["messages"][0]["content"].splitlines()[0] for r in engine.completions()}
    assert len(first_lines) == 3 * WORKLOAD.sessions * len(WORKLOAD.history_tokens)


async def test_decoding_sessions_stream_beside_the_agent_sessions(
    deployment: Deployment, cluster: StubCluster
) -> None:
    workload = replace(WORKLOAD, decoders=2, decode_tokens=20)
    async with serve_mode("agentkv", deployment) as target:
        report, close = http_reporter(target.base_urls[0], SECRET)
        cluster.reporter = report
        try:
            run = await Runner(workload, WordTokenizer()).run(target, 0, "t")
            await cluster.flush_reports()
        finally:
            await close()
    assert len(run.turns) == workload.sessions * workload.turns and all(r.ok for r in run.turns)
    assert {(d.mode, d.history_tokens) for d in run.decodes} == {("agentkv", 400)}
    assert {d.decoder for d in run.decodes} == {0, 1}
    assert all(d.error is None and d.ttft_s is not None for d in run.decodes)
    # A finished request of 20 streamed tokens has 19 gaps; each decoder's last one was cut.
    assert all(len(d.gaps_s) == 19 for d in run.decodes if d.complete)
    for decoder in (0, 1):
        mine = sorted((d for d in run.decodes if d.decoder == decoder), key=lambda d: d.request)
        assert [d.request for d in mine] == list(range(len(mine)))
        assert all(d.complete for d in mine[:-1])
        # On the turns' clock: each request sent after the one before it had streamed.
        for before, after in itertools.pairwise(mine):
            assert after.sent_s >= before.sent_s + before.ttft_s + sum(before.gaps_s)
    # The first requests went out before the first turn, on the same clock.
    assert max(d.sent_s for d in run.decodes if d.request == 0) < min(r.sent_s for r in run.turns)
    # The decoders streamed before the first turn was sent, without a session.
    sent = decode_engine(cluster).completions()
    assert "decoder" in sent[0].body["messages"][0]["content"]
    decoding = [r for r in sent if "decoder" in r.body["messages"][0]["content"]]
    assert all(r.body["max_tokens"] == 20 and not r.headers.get("x-session-id") for r in decoding)


async def test_a_failing_decoder_records_its_error_and_stops() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    workload = replace(WORKLOAD, decoders=1, sessions=1)
    run = await Runner(workload, WordTokenizer()).run(Target("aggregated", (url,), MODEL), 0, "t")
    assert [d.request for d in run.decodes] == [0]  # no second request after a failure
    assert "Connection error" in (run.decodes[0].error or "") and run.decodes[0].gaps_s == ()
    assert len(run.turns) == 1 and not run.turns[0].ok  # the agent session still ran


async def test_upstream_mode_never_reuses_streamed_turns(
    deployment: Deployment, cluster: StubCluster
) -> None:
    """vLLM's example proxy learns holdings only from non-streamed answers: bench streams."""
    records = await run_mode("upstream", deployment, cluster)
    assert all(r.ok and r.kv_path == "recompute" and not r.reused_tokens for r in records)


async def test_upstream_best_mode_reuses_streamed_turns_and_keeps_the_last_one(
    deployment: Deployment, cluster: StubCluster
) -> None:
    """The proxy at its best: streamed turns report their holding, follow-ups pull it, and the
    last turn's KV stays for the engines' fixed 480 s (no session-end hint, no release)."""
    records = await run_mode("upstream-best", deployment, cluster)
    followups = [r for r in records if r.turn > 1]
    assert all(r.ok for r in records) and len(followups) == 4
    assert all(r.kv_path == "reuse" and (r.reused_tokens or 0) > 400 for r in followups)
    retained = decode_engine(cluster).retained.values()
    assert len(retained) == WORKLOAD.sessions
    assert all(r.deadline - time.monotonic() > 470 for r in retained)


async def test_planned_sessions_start_late_and_idle_ones_never_end(
    deployment: Deployment, cluster: StubCluster
) -> None:
    """The pressure sweep's sessions: each from its own plan, all at once; a session that goes
    idle keeps its last turn's KV (no session-end hint), one that ends frees it."""
    plans = [
        SessionPlan(0, 300, start_s=0.0, gaps_s=(0.01,), ends=True),
        SessionPlan(1, 500, start_s=0.2, gaps_s=(0.01, 0.01), ends=False),
    ]
    async with serve_mode("agentkv", deployment) as target:
        report, close = http_reporter(target.base_urls[0], SECRET)
        cluster.reporter = report
        try:
            records = await Runner(WORKLOAD, WordTokenizer()).run_plans(target, 0, "t", plans)
            await cluster.flush_reports()
        finally:
            await close()
    assert sorted((r.session, r.turn, r.history_tokens) for r in records) == [
        (0, 1, 300), (0, 2, 300), (1, 1, 500), (1, 2, 500), (1, 3, 500),
    ]  # fmt: skip
    assert all(r.ok and r.pressure_sessions == 2 for r in records)
    late = min(r.sent_s or 0 for r in records if r.session == 1)
    assert late >= 0.2 and all((r.ended_s or 0) > (r.sent_s or 0) for r in records)
    retained = decode_engine(cluster).retained.values()
    assert [r.num_tokens > 500 for r in retained] == [True]  # the idle session's last turn


def test_a_session_is_named_apart_in_every_sweep_point() -> None:
    """One session runs in several sweep points: its name (and so its salted history) differs,
    so no point's prefix cache serves another's."""
    plan = SessionPlan(3, 2000, 0.0, ())
    names = {session_name("t", "agentkv", 0, plan, n) for n in (None, 4, 8)}
    assert len(names) == 3 and all(name.endswith("-h2000-s3") for name in names)
