"""Minimal reproduction: once a NIXL reader has sent the holder a notification, its later READs
complete only while the holder's UCX worker makes progress (docs/upstream/nixl-progress.md).

Two agents in two processes on one machine, configured as vLLM's NIXL connector configures
them on a CPU engine (UCX backend, progress thread on, UCX_TLS=self,sm,tcp). Each reader (a
fresh pair) reads the holder's buffer while the holder runs or is frozen (SIGSTOP). The bytes
move by cma, which needs nothing from the holder, and a pair that has carried no notification
reads from a frozen holder, the READ that carries the first notification included; every READ
after a notification waits until the holder runs again. vLLM's pull attaches a notification to
every READ, so each pair of engines depends on its holder from its first pull on.

    UCX_TLS=self,sm,tcp UCX_NET_DEVICES=lo python docs/upstream/nixl_read_needs_holder.py
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import time

SIZE = 48 << 20
DESCRIPTORS = 256
WAIT_S = 5.0


def hold(conn) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("holder", nixl_agent_config(num_threads=0))
    buffer = ctypes.create_string_buffer(b"\x01" * SIZE, SIZE)
    agent.register_memory(agent.get_reg_descs([(ctypes.addressof(buffer), SIZE, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), ctypes.addressof(buffer)))
    while True:  # an engine loop: drain notifications
        agent.get_new_notifs()
        time.sleep(0.01)


def read(agent, remote, local_base: int, remote_base: int, notif: bytes) -> tuple[str, float]:
    step = SIZE // DESCRIPTORS
    local = agent.get_xfer_descs(
        [(local_base + i * step, step, 0) for i in range(DESCRIPTORS)], "DRAM"
    )
    held = agent.get_xfer_descs(
        [(remote_base + i * step, step, 0) for i in range(DESCRIPTORS)], "DRAM"
    )
    began = time.monotonic()
    handle = agent.initialize_xfer("READ", local, held, remote, notif)
    state = agent.transfer(handle)
    while state == "PROC" and time.monotonic() - began < WAIT_S:
        time.sleep(0.001)
        state = agent.check_xfer_state(handle)
    return state, time.monotonic() - began


def reader(name: str, metadata: bytes):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(num_threads=0))
    buffer = ctypes.create_string_buffer(SIZE)
    agent.register_memory(agent.get_reg_descs([(ctypes.addressof(buffer), SIZE, 0, "")], "DRAM"))
    return agent, agent.add_remote_agent(metadata), buffer


def main() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    holder = context.Process(target=hold, args=(theirs,), daemon=True)
    holder.start()
    metadata, remote_base = ours.recv()
    scenarios = {
        # vLLM's pull: every READ carries a notification, the first one while the holder runs
        "reader-a": [("running", b"turn-1"), ("stopped", b""), ("stopped", b"turn-2")],
        # control: the first notification reaches a frozen holder
        "reader-b": [("running", b""), ("stopped", b"turn-1"), ("stopped", b"")],
    }
    for name, steps in scenarios.items():
        os.kill(holder.pid, signal.SIGCONT)
        agent, remote, buffer = reader(name, metadata)
        for state, notif in steps:
            os.kill(holder.pid, signal.SIGCONT if state == "running" else signal.SIGSTOP)
            what = "READ + notification" if notif else "READ alone         "
            base = ctypes.addressof(buffer)
            result, seconds = read(agent, remote, base, remote_base, notif)
            print(f"{name}, holder {state}: {what} -> {result} in {seconds:.3f} s")
    holder.kill()


if __name__ == "__main__":
    main()
