"""Worker half of ``AgentKVConnector``: NixlConnector's pull worker, made safe on CPU engines.

Six changes to upstream:

* **Thread affinity.** On the CPU platform ``NixlBaseConnectorWorker.__init__`` calls
  ``os.sched_setaffinity(0, last_core_of_each_numa_node)`` to keep KV transfers off the cores
  that run the model. ``pid 0`` means the *calling thread*, which is the worker's main thread:
  the one that runs every forward pass. Its ``VLLM_CPU_OMP_THREADS_BIND`` core is overridden,
  so on a small machine every engine's forward thread lands on the same last core, next to
  the other engines' spinning threads, and a prefill engine can starve for minutes (the
  "stall" in docs/connector.md). We restore the thread's own affinity after upstream's
  constructor; threads NIXL started meanwhile keep the reserved core, as upstream intends.
* **Progress thread paced.** NIXL's progress thread polls without pause, a core per engine
  even when nothing moves; the agent is built with a poll timeout (``progress.py``), so the
  thread sleeps until UCX has an event, or ``nixl_progress_delay_us`` passes.
* **Polling threads demoted, on request.** With ``demote_transfer_threads`` the native threads
  upstream's constructor starts are moved to ``SCHED_IDLE``. Off by default: the paced thread
  takes almost nothing, and at ``SCHED_IDLE`` a loaded holder served reads only when no forward
  pass wanted its core (pulls stalled for 30 s; docs/connector.md).
* **Pull deadline.** A pull still in its handshake or read after ``pull_timeout_seconds``, plus
  its size at ``PULL_FLOOR_BYTES_PER_SECOND``, is abandoned and reported as a failed load, which
  the scheduler turns into a recompute (``kv_load_failure_policy="recompute"``). Its peer is
  quarantined as if its read had failed: transfers between a pair of live engines can stop
  (every read between them then sits in flight, seen for minutes on end), and the peer's other
  pulls would each wait out their own deadline (docs/faults.md, "Pulls that stall").
* **Dead peers.** A read that ends in an error (NIXL_ERR_REMOTE_DISCONNECT from a killed holder)
  fails its request at once, drops its handle even when NIXL will not release it, fails every
  other pull from that engine, and quarantines the engine for ``dead_peer_seconds``; so does a
  read that NIXL refuses to post (``transfer()`` raises it for a holder already dead). No
  handshake, read or heartbeat goes to it meanwhile. A peer a read waits on is probed off the
  worker thread (``peers.py``): a refused connection counts as that error (docs/connector.md,
  "Dead peers").
* **Synchronous loads.** A load the scheduler half scheduled at once (``syncload.py``) is read
  before the step's forward pass: its reads are posted and waited for, at most
  ``sync_load_timeout_seconds``. One that failed, stalled or could not start reports its
  blocks invalid (``get_block_ids_with_load_errors``), and vLLM computes them in this request
  (``kv_load_failure_policy="recompute"``); it is never reported as a finished receive, which
  vLLM expects only of requests still waiting for their KV.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

from agentkv_server.connector.affinity import (
    demote_to_idle_priority,
    native_threads_started,
    preserved_thread_affinity,
)
from agentkv_server.connector.deadlines import Deadlines
from agentkv_server.connector.log import get_logger
from agentkv_server.connector.peers import PeerProbe
from agentkv_server.connector.progress import nixl_progress_delay
from agentkv_server.connector.settings import ConnectorSettings
from agentkv_server.connector.syncload import sync_loads_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import ReqMeta
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["AgentKVWorker"]

logger = get_logger(__name__)

# How long an abandoned pull's id is remembered: longer than any handshake can still complete
# (upstream's 5 s ZMQ timeout per remote rank).
_ABANDONED_MEMORY_SECONDS = 600.0
# A live listener on this machine or its network answers a connect in well under this.
_PEER_PROBE_TIMEOUT_SECONDS = 0.5
# The slowest read rate a pull is granted beyond ``pull_timeout_seconds``: a large context
# over a slow link gets time in proportion, a stalled read is still found in seconds.
PULL_FLOOR_BYTES_PER_SECOND = 500e6
# How often a synchronous load's reads are checked while the forward pass waits for them.
_SYNC_POLL_SECONDS = 0.0002


class AgentKVWorker(NixlPullConnectorWorker):
    """NixlConnector's pull worker that keeps its thread's cores, paces NIXL's polling thread,
    and bounds every pull."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
    ) -> None:
        with (
            preserved_thread_affinity(),
            native_threads_started() as started,
            nixl_progress_delay(settings.nixl_progress_delay_us),
        ):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        if settings.demote_transfer_threads:
            demoted = demote_to_idle_priority(started)
            logger.info("Demoted %d NIXL thread(s) to SCHED_IDLE: %s", len(demoted), demoted)
        self._pull_deadlines = Deadlines()
        self._pull_timeout = settings.pull_timeout_seconds
        self._abandoned = Deadlines()
        self._quarantine = Deadlines()
        self._dead_peer_seconds = settings.dead_peer_seconds
        self._sync_load_timeout = settings.sync_load_timeout_seconds
        self._peer_probe = (
            PeerProbe(timeout=_PEER_PROBE_TIMEOUT_SECONDS, interval=settings.peer_probe_seconds)
            if settings.peer_probe_seconds > 0
            else None
        )

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        now = time.monotonic()
        self._quarantine.pop_overdue(now)
        for req_id, meta in metadata.reqs_to_recv.items():
            self._pull_deadlines.set(req_id, now + self._pull_allowance(meta))
        for engine_id in [e for e in metadata.heartbeat_by_engine if e in self._quarantine]:
            del metadata.heartbeat_by_engine[engine_id]  # no handshake to a dead peer
        super().start_load_kv(metadata)
        for req_id in sync_loads_of(metadata) & self._recving_metadata.keys():
            self._complete_sync_load(req_id)

    def _complete_sync_load(self, req_id: str) -> None:
        """Wait for a synchronous load's reads; one not done in time fails its blocks."""
        deadline = time.monotonic() + self._sync_load_timeout
        while not self._reads_ended(req_id) and time.monotonic() < deadline:
            time.sleep(_SYNC_POLL_SECONDS)
            while not self._ready_requests.empty():  # a handshake finished meanwhile
                self._read_blocks_for_req(*self._ready_requests.get_nowait())
        posted = self._recving_transfers.pop(req_id, None)
        transfers = {} if posted is None else {req_id: posted}
        done, _ = self._pop_done_transfers(transfers)  # releases finished reads' handles
        if req_id in done and req_id not in self._recv_failures:
            if self._needs_conversion(req_id):
                logger.error(
                    "Request %s: its KV needs converting after the read, which a synchronous "
                    "load skips; it is computed instead. Set agentkv_sync_load_max_tokens=0 "
                    "for engine pairs whose block sizes or layouts differ.", req_id,
                )  # fmt: skip
                self._fail_sync_load(req_id)
                return
            self._recving_metadata.pop(req_id)
            self._pull_deadlines.discard(req_id)
            self._send_pending_recv_notifs(req_id)
            return
        self._recving_transfers.update(transfers)  # reads still running, for the abort below
        if req_id not in self._recv_failures:
            stalled = posted is not None
            why = "no transfer within its synchronous wait" if stalled else "no read posted"
            engine_id = self._remote_engine_of(req_id)
            self._abandon_pull(req_id, why)
            if stalled and engine_id is not None and engine_id not in self._quarantine:
                self._quarantine_peer(engine_id)
        self._fail_sync_load(req_id)

    def _reads_ended(self, req_id: str) -> bool:
        """Whether a pull has failed, or every read it posted has left NIXL's running state."""
        if req_id in self._recv_failures:
            return True
        handles = self._recving_transfers.get(req_id)
        return handles is not None and not any(self._transfer_running(h) for h in handles)

    def _needs_conversion(self, req_id: str) -> bool:
        """Whether upstream converts this pull's blocks after the read (other block sizes or
        layouts than the peer's), which it does only for asynchronous loads."""
        meta = self._recving_metadata[req_id]
        assert meta.remote is not None and self.transfer_topo is not None
        remote = self.transfer_topo.get_engine_info(meta.remote.engine_id)
        return (
            self.enable_permute_local_kv
            or self.enable_heterogeneous_attn_post_process
            or getattr(meta, "region_blocks_to_zero", None) is not None
            or self.transfer_topo.block_size_ratio(remote.remote_block_size) != 1
            or remote.remote_physical_blocks_per_logical
            != self._physical_blocks_per_logical_kv_block
        )

    def _fail_sync_load(self, req_id: str) -> None:
        """Report a synchronous load's blocks invalid and forget it: vLLM computes them."""
        kept = self._recving_transfers.pop(req_id, None)
        if kept:
            logger.warning(
                "Request %s: %d read(s) NIXL would not stop are dropped; they can only write "
                "the prefill engine's KV of the same tokens.", req_id, len(kept),
            )  # fmt: skip
        self._recv_failures.discard(req_id)
        self._pending_recv_notifs.pop(req_id, None)
        self._pull_deadlines.discard(req_id)
        meta = self._recving_metadata.pop(req_id)
        self._invalid_block_ids.put({block for group in meta.local_block_ids for block in group})

    def _pull_allowance(self, meta: ReqMeta) -> float:
        """Seconds a pull may take: the timeout, plus its bytes at the floor rate."""
        blocks = sum(len(group) for group in meta.local_block_ids)
        block_bytes = sum(self.block_len_per_layer)
        return self._pull_timeout + blocks * block_bytes / PULL_FLOOR_BYTES_PER_SECOND

    def _read_blocks_for_req(self, req_id: str, meta: ReqMeta) -> None:
        """Post a pull's reads, unless it was abandoned or its peer is quarantined.

        Upstream calls this for new pulls and again when a pull's handshake completes; a pull
        abandoned meanwhile must post nothing, its blocks are no longer its own.
        """
        if req_id in self._abandoned:
            self._abandoned.discard(req_id)
            return
        assert meta.remote is not None
        if meta.remote.engine_id in self._quarantine:
            logger.warning(
                "Not pulling request %s from engine %s, whose last transfer failed: "
                "the request recomputes its prefix instead.",
                req_id,
                meta.remote.engine_id,
            )
            self._handle_failed_transfer(
                req_id, None, self._recv_failures, record_failed_transfer=False
            )
            return
        super()._read_blocks_for_req(req_id, meta)

    def _read_blocks(self, **read: Any) -> bool:
        """Upstream's post of one read; one it could not post quarantines the peer at once.

        Upstream has already failed the request (it recomputes); without the quarantine, the
        peer's other pulls would each wait for their own read to fail or for the next probe.
        """
        posted = super()._read_blocks(**read)
        if not posted:
            self._quarantine_peer(read["dst_engine_id"])
        return posted

    def get_transfer_results(self) -> KVConnectorTransferResults:
        now = time.monotonic()
        self._abandoned.pop_overdue(now)
        self._probe_read_peers(now)
        self._abort_overdue_pulls()
        results = super().get_transfer_results()
        for req_id in results.finished_recving:
            self._pull_deadlines.discard(req_id)
        return results

    def shutdown(self) -> None:
        probe = getattr(self, "_peer_probe", None)  # absent when the constructor failed
        if probe is not None:
            probe.shutdown()
        super().shutdown()

    def _probe_read_peers(self, now: float) -> None:
        """Quarantine peers whose handshake listener is gone; probe those reads wait on."""
        if self._peer_probe is None:
            return
        for engine_id in self._peer_probe.dead():
            logger.warning("Engine %s refuses connections: its process is gone.", engine_id)
            self._quarantine_peer(engine_id)
        for req_id in self._recving_transfers:
            meta = self._recving_metadata.get(req_id)
            remote = None if meta is None else meta.remote
            if remote is not None and remote.engine_id not in self._quarantine:
                self._peer_probe.probe(remote.engine_id, remote.host, remote.port, now)

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        """Upstream's poll; a failed read also fails every other pull from the same engine."""
        done, failed = super()._pop_done_transfers(transfers)
        self._recv_failures.update(failed)
        for engine_id in {self._remote_engine_of(req_id) for req_id in failed} - {None}:
            self._quarantine_peer(engine_id)
        return done, failed

    def _try_release_xfer_handle(self, req_id: str, handle: int) -> bool:
        """Release a handle; drop it anyway once its transfer has ended.

        Upstream keeps a handle NIXL would not release, and with it the request parked and its
        blocks held, because a transfer that is still running can write into them. A transfer
        in a terminal state (ERR, or a state check that raises, as NIXL_ERR_REMOTE_DISCONNECT
        does) cannot: UCX has failed it, and in a READ every byte that lands in our blocks comes
        from the peer, which is gone. The dropped handle is left to NIXL's own finalizer.
        """
        running = self._transfer_running(handle)  # NIXL's state, before release overwrites it
        if super()._try_release_xfer_handle(req_id, handle):
            return True
        if running:
            return False
        logger.warning(
            "Dropping the ended transfer of request %s that NIXL did not release.", req_id
        )
        return True

    def _read_finished(self, req_id: str) -> bool:
        """Whether every read of a pull has completed, not yet polled by upstream."""
        handles = self._recving_transfers.get(req_id)
        return bool(handles) and all(self._transfer_state(h) == "DONE" for h in handles)

    def _transfer_state(self, handle: int) -> str:
        try:
            return str(self.nixl_wrapper.check_xfer_state(handle))
        except Exception:  # noqa: BLE001 - NIXL raises one class per error status
            return "ERR"

    def _transfer_running(self, handle: int) -> bool:
        try:
            return self.nixl_wrapper.check_xfer_state(handle) == "PROC"
        except Exception:  # noqa: BLE001 - NIXL raises one class per error status; all end it
            return False

    def _remote_engine_of(self, req_id: str) -> str | None:
        meta = self._recving_metadata.get(req_id)
        return None if meta is None or meta.remote is None else meta.remote.engine_id

    def _quarantine_peer(self, engine_id: str) -> None:
        """Fail every pull from ``engine_id`` now and send it nothing for a while.

        Upstream's invalid-peer path then releases the engine's NIXL state once its reads
        drain, so a restarted engine (same engine id, new agent) is handshaken afresh.
        """
        now = time.monotonic()
        self._quarantine.discard(engine_id)
        self._quarantine.set(engine_id, now + self._dead_peer_seconds)
        if engine_id in self._remote_agents:
            self._mark_remote_engine_invalid(engine_id, time.perf_counter())
        for req_id in list(self._recving_metadata):
            if self._remote_engine_of(req_id) == engine_id and req_id not in self._recv_failures:
                self._abandon_pull(req_id, "its peer's transfer failed")

    def _abort_overdue_pulls(self) -> None:
        """Abandon pulls, in handshake or read, that outlived their deadline, and quarantine
        their peers: what stalled one read stalls the next between the same pair."""
        for req_id in self._pull_deadlines.pop_overdue(time.monotonic()):
            if req_id not in self._recving_metadata or req_id in self._recv_failures:
                continue
            if self._read_finished(req_id):
                continue  # done since the last step's poll (a long step): upstream reports it
            engine_id = self._remote_engine_of(req_id)
            self._abandon_pull(req_id, "no transfer within its deadline")
            if engine_id is not None and engine_id not in self._quarantine:
                logger.warning(
                    "Engine %s: a pull from it stalled; no pull goes to it for %.0f s.",
                    engine_id, self._dead_peer_seconds,
                )  # fmt: skip
                self._quarantine_peer(engine_id)

    def _abandon_pull(self, req_id: str, why: str) -> None:
        """Report a pull as a failed load (the request recomputes) and stop its transfer.

        Each posted read is released (aborted); one NIXL reports still running keeps its
        handle, and the request its blocks, until it really stops. A pull still in its
        handshake is marked abandoned, so the handshake's late completion posts nothing.
        """
        logger.warning("Abandoning the KV pull of request %s (%s): it recomputes.", req_id, why)
        handles = self._recving_transfers.pop(req_id, None)
        if handles is None:
            self._abandoned.set(req_id, time.monotonic() + _ABANDONED_MEMORY_SECONDS)
            self._handle_failed_transfer(
                req_id, None, self._recv_failures, record_failed_transfer=False
            )
            return
        kept = [
            handle
            for handle in handles
            if not self._handle_failed_transfer(req_id, handle, self._recv_failures)
        ]
        self._recv_failures.add(req_id)
        if kept:
            self._recving_transfers[req_id] = kept
