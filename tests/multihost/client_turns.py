"""The agent on the client host: one agentkv session whose turns go to the routers it is told.

Run inside the client's namespace by tests/multihost. Reads one JSON line per turn from stdin,
``{"router": URL, "prompt": [token ids]}``, makes the call through ``agentkv.OpenAI`` inside one
``agentkv.session``, and writes one JSON line back: what the router reported (kv path, reused
tokens), the output token ids, and the seconds the call took. Token-id prompts let the test make
each turn extend the previous turn's held tokens exactly.
"""

from __future__ import annotations

import json
import sys
import time

import agentkv

OUTPUT_TOKENS = 100  # held beyond P's own prefix cache: more than its recompute threshold (64)


def main() -> None:
    session_id, model = sys.argv[1], sys.argv[2]
    clients: dict[str, agentkv.OpenAI] = {}
    with agentkv.session(session_id) as session:
        for line in sys.stdin:
            turn = json.loads(line)
            client = clients.setdefault(
                turn["router"],
                agentkv.OpenAI(base_url=turn["router"] + "/v1", api_key="unused", max_retries=0),
            )
            began = time.monotonic()
            answer = client.completions.create(
                model=model,
                prompt=turn["prompt"],
                max_tokens=OUTPUT_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
                timeout=120,
            )
            info = session.last_turn
            assert info is not None
            report = {
                "kv_path": info.kv_path,
                "reused_tokens": info.reused_tokens,
                "token_ids": answer.choices[0].model_extra["token_ids"],
                "seconds": time.monotonic() - began,
            }
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
