from __future__ import annotations

import pytest

import agentkv
from agentkv.testing import FakeRouter


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture
def client(router: FakeRouter) -> agentkv.OpenAI:
    return agentkv.OpenAI(api_key="test", http_client=router.http_client())


@pytest.fixture
def async_client(router: FakeRouter) -> agentkv.AsyncOpenAI:
    return agentkv.AsyncOpenAI(api_key="test", http_client=router.async_http_client())
