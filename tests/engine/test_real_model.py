"""The default model as ``agentkv serve`` serves it (no ``--model``): real words, not noise."""

from __future__ import annotations

import pytest

import agentkv
from agentkv_server.bundle.packaged_model import SMOLLM2
from agentkv_server.bundle.stack import Stack

pytestmark = pytest.mark.engine


def test_the_default_model_answers_a_factual_question(real_stack: Stack) -> None:
    assert real_stack.served_name == SMOLLM2.served_name
    client = agentkv.OpenAI(base_url=f"{real_stack.endpoint}/v1", api_key="-")
    with agentkv.session():
        reply = client.chat.completions.create(
            model=real_stack.served_name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
    assert "Paris" in (reply.choices[0].message.content or "")
