"""One turn through prefill (P) and decode (D) engines, with KV reuse and every fallback.

1. Plan (plan.py): take the session's holding, count the prompt's new tokens on the holder and
   let the policy choose: continue on the holder (``local``), pull, or recompute. The plan is
   frozen; the turn (turn.py) records what happens instead.
2. Local step (steps.py): the D step on the holder alone. If the holder fails before its first
   byte, the turn is recomputed through P on another decode engine (a ``fallback``).
3. P step (steps.py, one output token): the holding's params plus ``do_remote_decode`` for a
   pull, the cold params otherwise. A failed pull is retried cold (a ``fallback``), a failed
   step on other P engines; with none left the turn is served decode-only.
4. D step (steps.py): P's returned params plus agentkv's retention and ticket, preferring the
   holder, among engines whose KV transfers with P work (pairs.py). A failure before the first
   byte is retried on another D engine; a stream is then relayed chunk by chunk and continued
   elsewhere if its engine breaks (relay.py).
5. The holding is replaced from D's response body (non-streamed), D's report (streamed), or
   the last event of a streamed Responses answer, whichever comes first.

Steps 2-4 and a stream's continuation run through one attempt loop (attempts.py), every engine
call under the watchdog (services.py): a step whose engine stops answering or making progress
is aborted within seconds and served elsewhere, and the engine is suspect. The client sees an
error only when no engine can serve it, or when an engine refused the request itself (a 4xx,
passed back as the engine wrote it).
"""

from agentkv_server.router.orchestrator.flow import Orchestrator

__all__ = ["Orchestrator"]
