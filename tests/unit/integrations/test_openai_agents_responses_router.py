"""An Agents SDK agent on its default model (OpenAIResponsesModel) through the real router app
(in-process) and stub engines: its runs are one session on the wire, and the second reuses KV."""

from __future__ import annotations

from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, SQLiteSession

import agentkv
from agentkv_openai_agents import Runner, conversation_session
from agentkv_server.testing import StubCluster
from agentkv_server.testing.harness import in_process_router

INSTRUCTIONS = " ".join(f"rule{i}" for i in range(300))


async def test_default_responses_model_runs_share_a_session_and_reuse_kv():
    cluster = StubCluster()
    try:
        async with in_process_router(cluster, policy="always") as router:
            client = agentkv.AsyncOpenAI(
                base_url="http://router/v1", api_key="unused", http_client=router.client
            )
            agent = Agent(
                name="assistant",
                instructions=INSTRUCTIONS,
                model=OpenAIResponsesModel(model=cluster.model, openai_client=client),
                model_settings=ModelSettings(max_tokens=4),
            )
            memory = SQLiteSession("agents-responses")
            config = RunConfig(tracing_disabled=True)
            first = await Runner.run(agent, "hello there", session=memory, run_config=config)
            await cluster.flush_reports()
            second = await Runner.run(agent, "and then?", session=memory, run_config=config)
    finally:
        await cluster.close()

    assert first.final_output == second.final_output == "w0 w1 w2 w3 "
    turns = conversation_session(memory).turns
    assert [turn.kv_path for turn in turns] == ["recompute", "reuse"]
    assert (turns[1].reused_tokens or 0) > 300
    calls = router.decode[0].completions()
    assert [call.path for call in calls] == ["/v1/responses"] * 2
    assert all(call.body["instructions"] == INSTRUCTIONS for call in calls)
