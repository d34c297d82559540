"""Real NIXL: what a read from a SIGKILLed holder looks like, as the worker's dead-peer path sees it.

A holder agent in its own process registers a buffer; this process loads its metadata and reads
it once (the previous turn), then the holder is killed and the next read is posted. The worker
relies on NIXL ending that read in an error state (here: at once, NIXL_ERR_REMOTE_DISCONNECT)
and on such a handle being released or dropped, never kept.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace
from unittest import mock

import pytest
from nixl_cu12._api import nixl_agent as NixlWrapper  # the backend vLLM loads here
from nixl_cu12._api import nixl_agent_config

SIZE = 4 << 20


def new_agent(name: str) -> NixlWrapper:
    return NixlWrapper(name, nixl_agent_config(backends=["UCX"]))


def hold(conn: Connection) -> None:
    agent = new_agent("holder")
    buffer = ctypes.create_string_buffer(b"\x01" * SIZE, SIZE)
    address = ctypes.addressof(buffer)
    agent.register_memory(agent.get_reg_descs([(address, SIZE, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), address))
    while True:
        time.sleep(1)


def state_within(agent: NixlWrapper, handle: object, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = agent.check_xfer_state(handle)
        except Exception as exc:  # noqa: BLE001 - NIXL raises one class per error status
            return type(exc).__name__
        if state != "PROC":
            return state
        time.sleep(0.01)
    return "PROC"


def test_a_read_from_a_killed_holder_ends_in_an_error_and_its_handle_is_not_kept() -> None:
    # Imported here: the holder process re-imports this module and must not load vLLM.
    from agentkv_server.connector.worker import AgentKVWorker

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    holder = context.Process(target=hold, args=(theirs,), daemon=True)
    holder.start()
    try:
        # The holder re-imports this module by its package path: `python -m pytest` from the
        # repository root (README), which puts the root on the spawned process's path.
        assert ours.poll(60), f"the holder process did not start (exit code {holder.exitcode})"
        metadata, remote_address = ours.recv()
        agent = new_agent("puller")
        buffer = ctypes.create_string_buffer(SIZE)
        address = ctypes.addressof(buffer)
        agent.register_memory(agent.get_reg_descs([(address, SIZE, 0, "")], "DRAM"))
        remote = agent.add_remote_agent(metadata)
        local = agent.get_xfer_descs([(address, SIZE, 0)], "DRAM")
        held = agent.get_xfer_descs([(remote_address, SIZE, 0)], "DRAM")

        warm = agent.initialize_xfer("READ", local, held, remote, b"turn-1")
        agent.transfer(warm)
        assert state_within(agent, warm, 30) == "DONE"
        assert b"\x00" not in buffer.raw  # the holder's bytes arrived
        agent.release_xfer_handle(warm)

        os.kill(holder.pid or 0, signal.SIGKILL)
        holder.join(10)
        handle = agent.initialize_xfer("READ", local, held, remote, b"turn-2")
        with pytest.raises(Exception, match="REMOTE_DISCONNECT"):
            agent.transfer(handle)  # vLLM's _read_blocks fails the request right here
        assert state_within(agent, handle, 5) == "nixlRemoteDisconnectError"

        worker = object.__new__(AgentKVWorker)
        worker.nixl_wrapper = agent
        worker.xfer_stats = mock.Mock()
        worker._recving_metadata = {"r": SimpleNamespace(remote=None)}
        assert not worker._transfer_running(handle)
        assert worker._try_release_xfer_handle("r", handle)  # released, not kept
    finally:
        if holder.is_alive():
            holder.kill()
