"""What remembering a stream for its continuation costs the router per chunk (docs/faults.md,
"A stream that breaks"): vLLM-shaped completion chunks through the plain ``[DONE]`` splitter,
through the resumable editor (ids asked for, then written back as ``null``), and chat chunks
through it; plus the parse that only a break pays.

    PYTHONPATH=server:sdk .venv/bin/python scripts/measure_stream_relay.py
"""

from __future__ import annotations

import json
import time

from agentkv_server.router.formats import StreamEditor, wire_format
from agentkv_server.router.resume import ResumableStream

CHUNKS = 20_000
PROMPT_IDS = 8_000


def completion_chunk(index: int, with_ids: bool) -> bytes:
    choice = {
        "index": 0,
        "text": f" tok{index}",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": list(range(PROMPT_IDS)) if with_ids and index == 0 else None,
        "token_ids": [1000 + index] if with_ids else None,
    }
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    data = json.dumps({**chunk, "choices": [choice]}, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def microseconds_per_chunk(editor: StreamEditor, chunks: list[bytes]) -> float:
    began = time.perf_counter()
    for chunk in chunks:
        editor.feed(chunk)
    return (time.perf_counter() - began) / len(chunks) * 1e6


def main() -> None:
    plain = [completion_chunk(i, False) for i in range(CHUNKS)]
    tracked = [completion_chunk(i, True) for i in range(CHUNKS)]
    splitter = microseconds_per_chunk(wire_format("completion").stream_editor(), plain)
    completion = microseconds_per_chunk(
        ResumableStream("completion", client_wants_ids=False), tracked
    )
    chat = microseconds_per_chunk(ResumableStream("chat", client_wants_ids=False), plain)
    print(
        f"per chunk: [DONE] splitter {splitter:.2f} us, resumable completion {completion:.2f} us, "
        f"resumable chat {chat:.2f} us"
    )
    editor = ResumableStream("completion", client_wants_ids=False)
    for chunk in tracked[:4000]:
        editor.feed(chunk)
    began = time.perf_counter()
    editor.progress()
    print(f"after a break, reading 4000 sent chunks: {(time.perf_counter() - began) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
