"""NIXL's progress thread delay: the agent's own ``pthrDelay = 0`` cannot lower it."""

from __future__ import annotations

import sys

from agentkv_server.connector.progress import delayed_config_class, nixl_progress_delay


def nixl_bindings():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    assert base_worker.NixlWrapper is not None, "NIXL does not import (scripts/install installs it)"
    return sys.modules[base_worker.NixlWrapper.__module__].nixlBind


def test_the_native_config_keeps_the_delay_when_set_to_zero() -> None:
    bindings = nixl_bindings()
    config = delayed_config_class(bindings.nixlAgentConfig, 10_000)()
    config.pthrDelay = 0  # what NIXL's python agent does
    assert config.pthrDelay == 10_000
    config.pthrDelay = 50_000
    assert config.pthrDelay == 50_000
    assert isinstance(config, bindings.nixlAgentConfig)


def test_the_block_swaps_the_config_class_and_puts_it_back() -> None:
    bindings = nixl_bindings()
    original = bindings.nixlAgentConfig
    with nixl_progress_delay(10_000):
        config = bindings.nixlAgentConfig()
        config.pthrDelay = 0
        assert config.pthrDelay == 10_000
    assert bindings.nixlAgentConfig is original


def test_zero_keeps_nixls_own_config() -> None:
    bindings = nixl_bindings()
    original = bindings.nixlAgentConfig
    with nixl_progress_delay(0):
        assert bindings.nixlAgentConfig is original
