"""Scheduler half of ``AgentKVConnector``: what a request's ``kv_transfer_params`` may ask for.

On a decode engine (D), when a request finishes:

* its blocks are retained for the request's ``agentkv_retention_seconds`` (clamped), not one
  fixed TTL; ``0`` frees them at once;
* the returned params gain its expiry (``agentkv_expires_in_seconds``, ``agentkv_expires_at``),
  a prefix fingerprint of the held tokens (``prefix.py``) and the engine's KV size
  (``capacity.py``), from which the router budgets what it keeps retained;
* with an ``agentkv_ticket``, the params are reported to the router (``report.py``).

On either engine, a request that waited for KV blocks before it was admitted returns how long,
and how much of that wait fell while the engine retained blocks for later pulls
(``agentkv_waited_for_blocks_seconds``, ``agentkv_waited_beside_retained_seconds``:
``blockwaits.py``). A request that loaded KV from a remote engine (D reading P's prompt, P
pulling a holding) returns how that load ended: ``agentkv_kv_load`` (``ok``, or ``failed`` when
the worker reported it in ``failed_recving`` and the request computed the prompt itself) and
``agentkv_kv_load_from``, the engine it loaded from. The router learns each engine pair's
transfer health from it (docs/router.md, "Pair health").

A decode engine that has loaded from a prefill engine before loads a short prompt part from it
synchronously: the request is computed in the step that reads it, not the one after
(``syncload.py``). A prefill engine's pulls of holdings stay asynchronous: a holding is long,
and a synchronous read would stall the engine's other prompts for it.

A request carrying ``agentkv_release`` frees the named retained requests' blocks at once, as
it arrives: a release of its own, or a decode step that needs their room. One carrying
``agentkv_renew`` keeps the named ones longer (their turn waits in the router's queue).
While released or expired blocks wait for the worker to free them (one step), a request that
finds no room waits for them rather than preempting another (``has_pending_block_frees``).

On a prefill engine (P) pulling a holding, only the longest prefix that its prompt really
shares with the held tokens is loaded: the matched-token count and the remote block list are
clipped to it before upstream's logic runs. A holding about to expire is not pulled at all, and
a request is pulled for at most once: one whose pull failed computes its prefix.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler
from vllm.utils.math_utils import cdiv

from agentkv_server import wire
from agentkv_server.connector.blockwaits import BlockWaits
from agentkv_server.connector.capacity import capacity_params
from agentkv_server.connector.idle import IdleBackoff, engine_input_queue, wait_for_input
from agentkv_server.connector.log import get_logger
from agentkv_server.connector.params import (
    expires_within,
    release_ids,
    renewals,
    retention_seconds,
)
from agentkv_server.connector.params import ticket as requested_ticket
from agentkv_server.connector.prefix import PrefixFingerprint, common_prefix_tokens
from agentkv_server.connector.report import HoldingReporter
from agentkv_server.connector.settings import ConnectorSettings
from agentkv_server.connector.syncload import mark_sync_loads

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import BlockIds
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AgentKVScheduler"]

logger = get_logger(__name__)

# Marks params whose pull was already checked (the scheduler may ask more than once).
_VERIFIED = "_agentkv_prefix_verified"
# Upstream's mark on params whose pull ``update_state_after_alloc`` has planned.
_PULL_PLANNED = "_remote_blocks_processed"
# Holdings this close to expiry are not pulled: the same slack upstream's worker leaves for
# clock error and read latency before it declines a read.
EXPIRY_MARGIN_SECONDS = 5.0
# Released or expired blocks are freed on the worker's next step: a free pending longer than
# this is not counted on (a request that finds no room then preempts, as upstream does).
PENDING_FREE_SECONDS = 1.0
# A request whose KV has arrived should run on the next step; this long after, it is reported.
LOADED_WAIT_WARNING_SECONDS = 2.0


class AgentKVScheduler(NixlPullConnectorScheduler):
    """NixlConnector's pull scheduler with request-driven retention and verified pulls."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._settings = settings
        # The engine's KV size, returned with every holding (the router's budget).
        self._capacity = capacity_params(kv_cache_config, self.block_size, settings.host_tier_bytes)
        # Finished requests whose blocks this engine retains for a later pull.
        self._retained: set[str] = set()
        # Their deadlines (perf_counter), for the frees that are pending.
        self._deadlines: dict[str, float] = {}
        self._reporter = (
            HoldingReporter(
                settings.report_url,
                secret=settings.secret,
                queue_size=settings.report_queue_size,
                timeout=settings.report_timeout_seconds,
            )
            if settings.report_url
            else None
        )
        # Requests the engine has not finished (loading, waiting or running): while any is
        # left the engine steps without pause, or nothing would notice it become schedulable.
        self._unfinished: dict[str, Request] = {}
        # Requests whose load finished and that the scheduler has not run since: when.
        self._loaded_at: dict[str, float] = {}
        # Requests that load KV from a remote engine: that engine, and how the load ended.
        self._loads: dict[str, _Load] = {}
        # Prefill engines this engine's last load from ended well: loads from them may be
        # synchronous (their handshake is done and their reads have worked).
        self._sync_peers: set[str] = set()
        # Requests last answered with a synchronous load, until their blocks are allocated:
        # the (block-aligned) tokens of their prompt found in the local prefix cache.
        self._sync_asked: dict[str, int] = {}
        self._block_waits = BlockWaits()
        self._idle = _idle_backoff(settings)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        # Called once per engine step, before the step runs: the place to pace an idle loop.
        self._block_waits.step(retaining=self._holdings_in_the_way)
        self._idle.step(busy=self._has_work(scheduler_output))
        self._note_loaded_requests_left_waiting(scheduler_output)
        meta = super().build_connector_meta(scheduler_output)
        self._dispatch_sync_loads(meta)
        return meta

    def _dispatch_sync_loads(self, meta: NixlConnectorMetadata) -> None:
        """Mark this step's synchronous loads for the worker; they need no heartbeat, as their
        read ends in this step."""
        sync = {
            req_id
            for req_id in meta.reqs_to_recv
            if (load := self._loads.get(req_id)) is not None and load.sync_blocks is not None
        }
        mark_sync_loads(meta, sync)
        for req_id in sync:
            self._loads[req_id].dispatched = True
            self._stop_heartbeat(req_id)

    def _note_loaded_requests_left_waiting(self, scheduler_output: SchedulerOutput) -> None:
        """Warn, once per request, when one whose KV arrived is still not scheduled after
        ``LOADED_WAIT_WARNING_SECONDS``, a suspect in pulls that stall (docs/faults.md)."""
        if not self._loaded_at:
            return
        now = time.monotonic()
        for req_id in list(self._loaded_at):
            request = self._unfinished.get(req_id)
            if request is None or req_id in scheduler_output.num_scheduled_tokens:
                del self._loaded_at[req_id]
            elif now - self._loaded_at[req_id] > LOADED_WAIT_WARNING_SECONDS:
                logger.warning(
                    "Request %s: its KV arrived %.1f s ago and it is not scheduled yet "
                    "(status %s, %d of %d tokens computed, %d unfinished requests)",
                    req_id, now - self._loaded_at.pop(req_id), request.status,
                    request.num_computed_tokens, request.num_tokens, len(self._unfinished),
                )  # fmt: skip

    def _has_work(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether this step must not wait: it computes, or a request is still unfinished.

        Only an engine whose requests have all finished (a decode engine retaining them for
        pulls) is paced. A request that waits (its KV loaded, or not yet admitted) with nothing
        scheduled keeps the engine stepping: a paced wait ends only on a new request, and its
        load's end or a freed slot is none (docs/connector.md, "Idle engines").
        """
        return (
            scheduler_output.total_num_scheduled_tokens > 0
            or bool(self._reqs_need_recv)
            or bool(self._unfinished)
        )

    # -- P: verified pulls ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """What P may load from the holding: its verified prefix, and only on the first ask.

        A request asks again when it is scheduled afresh: after its pull failed (the
        scheduler's ``recompute`` policy resets it) or after a preemption. Upstream answers
        with the same asynchronous load each time, but it plans a load only once per request,
        so the scheduler would park the request in ``WAITING_FOR_REMOTE_KVS`` for a load that
        never starts (docs/connector.md, "A pull that failed"). Its prefix is computed instead.
        """
        self._block_waits.asked(request.request_id)
        params = request.kv_transfer_params
        if _pulls_holding(params):
            if params.get(_PULL_PLANNED):
                return 0, False
            if not params.get(_VERIFIED):
                params[_VERIFIED] = True
                self._clip_to_loadable(request, params)
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._sync_asked.pop(request.request_id, None)
        # The step computes at least the prompt's last token: vLLM does that itself only for a
        # request whose asynchronous load covered the whole prompt.
        sync_count = min(count, request.num_prompt_tokens - 1 - num_computed_tokens)
        if load_async and self._may_load_synchronously(params, sync_count):
            self._sync_asked[request.request_id] = num_computed_tokens
            return sync_count, False
        return count, load_async

    def _may_load_synchronously(self, params: dict[str, Any] | None, count: int) -> bool:
        """A decode request's short read from a prefill engine whose last load ended well."""
        return bool(
            params
            and params.get(wire.DO_REMOTE_PREFILL)
            and 0 < count <= self._settings.sync_load_max_tokens
            and params.get(wire.REMOTE_ENGINE_ID) in self._sync_peers
            and not self.use_host_buffer  # its reads land in a buffer, copied after the step
            and not self._is_hma_required  # vLLM maps failed blocks back for one group only
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._block_waits.admitted(request.request_id)
        params = request.kv_transfer_params
        if _pulls_holding(params) and not params.get(_PULL_PLANNED):
            loaded = min(params.get(wire.REMOTE_NUM_TOKENS) or 0, request.num_prompt_tokens)
            _clip_remote_blocks(params, loaded_tokens=loaded)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        local_tokens = self._sync_asked.pop(request.request_id, None)
        if num_external_tokens > 0 and request.request_id in self._reqs_need_recv:
            # A read of ``num_external_tokens`` was planned: its outcome goes back in the params.
            remote = params.get(wire.REMOTE_ENGINE_ID) if params else None
            sync_blocks = None
            if local_tokens is not None:
                sync_blocks = frozenset(self._plan_sync_read(request, blocks, local_tokens)[0])
            self._loads[request.request_id] = _Load(str(remote), sync_blocks=sync_blocks)

    def _plan_sync_read(
        self, request: Request, blocks: KVCacheBlocks, local_tokens: int
    ) -> BlockIds:
        """Read every block past the local prefix hit; the blocks it reads into.

        Upstream reads into the blocks not yet cached, which for an asynchronous load are those
        past the hit. vLLM caches a synchronous load's whole blocks as it allocates them, before
        they are read: upstream's plan would read only the last, partial block.
        """
        _, _, _, awaiting = self._reqs_need_recv[request.request_id]
        skip = local_tokens // self.block_size
        past_hit = tuple(list(group[skip:]) for group in blocks.get_block_ids())
        read = self.get_exchange_clipped_blocks(past_hit)
        self._reqs_need_recv[request.request_id] = (request, read, (skip,) * len(read), awaiting)
        return read

    def _clip_to_loadable(self, request: Request, params: dict[str, Any]) -> None:
        """Clip ``remote_num_tokens`` (which upstream trusts) to what may really be loaded."""
        held = params.get(wire.REMOTE_NUM_TOKENS) or 0
        if expires_within(params, EXPIRY_MARGIN_SECONDS, now=time.time()):
            logger.info("Request %s: holding on %s has expired; recomputing",
                        request.request_id, params.get(wire.REMOTE_ENGINE_ID))  # fmt: skip
            # Nothing to read and nobody to notify: the holder frees expired blocks itself.
            params[wire.REMOTE_NUM_TOKENS] = 0
            params[wire.REMOTE_BLOCK_IDS] = None
            return
        loadable = self._verified_tokens(request, params, held)
        if loadable < held:
            logger.info(
                "Request %s shares only %d of the %d tokens that %s holds; pulling those",
                request.request_id,
                loadable,
                held,
                params.get(wire.REMOTE_ENGINE_ID),
            )
        params[wire.REMOTE_NUM_TOKENS] = loadable

    def _verified_tokens(self, request: Request, params: dict[str, Any], held: int) -> int:
        """The held tokens the prompt really shares; none without a usable fingerprint."""
        fingerprint = PrefixFingerprint.from_params(params)
        if fingerprint is None:
            return 0
        shared = min(held, common_prefix_tokens(fingerprint, request.prompt_token_ids or []))
        if shared < held and self._is_hma_required:
            # Hybrid models keep sliding-window and state groups whose blocks cannot be cut
            # at a token boundary: load all of the holding or none of it.
            return 0
        return shared

    # -- D: retention, release, reports --------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        self._unfinished[request.request_id] = request
        self._block_waits.arrived(request.request_id)
        for req_id in release_ids(request.kv_transfer_params):
            self._release(req_id)
        for req_id, seconds in renewals(request.kv_transfer_params).items():
            self._renew(req_id, seconds)

    def request_finished(
        self, request: Request, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        self._unfinished.pop(request.request_id, None)
        self._sync_asked.pop(request.request_id, None)
        load = self._loads.pop(request.request_id, None)
        if load is not None and load.dispatched and load.outcome is None:
            load.outcome = wire.KV_LOAD_OK  # a failed synchronous load is seen in its own step
            self._learn_peer(load)
        if load is not None and load.outcome is not None:
            # Also without upstream's params (a decode engine not in bidirectional mode).
            params = {} if params is None else params
            params[wire.KV_LOAD] = load.outcome
            params[wire.KV_LOAD_FROM] = load.engine_id
            if load.dispatched:
                params[wire.KV_LOAD_SYNC] = True
        if (waited := self._block_waits.finished(request.request_id)) is not None:
            params = {} if params is None else params
            params[wire.WAITED_FOR_BLOCKS_SECONDS] = round(waited.seconds, 3)
            params[wire.WAITED_BESIDE_RETAINED_SECONDS] = round(waited.beside_retained_s, 3)
            if waited.beside_retained_s > 0:
                logger.info(
                    "Request %s (%d prompt tokens) waited %.2f s for KV blocks, %.2f s of it "
                    "beside retained blocks; %d requests' blocks retained now",
                    request.request_id, request.num_prompt_tokens, waited.seconds,
                    waited.beside_retained_s, len(self._retained),
                )  # fmt: skip
        request_params = request.kv_transfer_params or {}
        if delay_free and params is not None and params.get(wire.DO_REMOTE_DECODE):
            delay_free = self._retain(request, params, request_params)
        ticket = requested_ticket(request_params)
        if ticket is not None and params is not None and self._reporter is not None:
            self._reporter.submit(ticket, params)
        return delay_free, params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        # Pulled, expired or released: the blocks are free either way.
        self._retained.difference_update(connector_output.finished_sending or ())
        loaded = set(connector_output.finished_recving or ()) & self._unfinished.keys()
        self._loaded_at.update(dict.fromkeys(loaded, time.monotonic()))
        self._note_load_outcomes(connector_output)
        self._note_sync_load_failures(connector_output)

    def _note_load_outcomes(self, connector_output: KVConnectorOutput) -> None:
        """A finished load failed if the worker also listed it in ``failed_recving`` (vLLM's
        scheduler then recomputes the request: ``kv_load_failure_policy="recompute"``)."""
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for req_id in set(connector_output.finished_recving or ()) | failed:
            load = self._loads.get(req_id)
            if load is not None and load.outcome is None:
                load.outcome = wire.KV_LOAD_FAILED if req_id in failed else wire.KV_LOAD_OK
                self._learn_peer(load)

    def _note_sync_load_failures(self, connector_output: KVConnectorOutput) -> None:
        """A synchronous load failed if the worker reported its blocks invalid (vLLM's
        scheduler then computes them in place)."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for load in self._loads.values():
            if load.sync_blocks and load.outcome is None and load.sync_blocks & invalid:
                load.outcome = wire.KV_LOAD_FAILED
                self._learn_peer(load)

    def _learn_peer(self, load: _Load) -> None:
        """Loads from a prefill engine may be synchronous while its last one ended well."""
        if load.outcome == wire.KV_LOAD_OK:
            self._sync_peers.add(load.engine_id)
        else:
            self._sync_peers.discard(load.engine_id)

    def _holdings_in_the_way(self) -> bool:
        """Whether a request short of blocks waits because of holdings: blocks retained here
        for later pulls, neither released nor expired, and no released ones on their way out
        (a wait for those is the release's own step: ``has_pending_block_frees``)."""
        now = time.perf_counter()
        live = any(self._deadlines.get(req_id, 0.0) > now for req_id in self._retained)
        return live and not self.has_pending_block_frees()

    def has_pending_block_frees(self) -> bool:
        """Whether retained blocks released or expired within ``PENDING_FREE_SECONDS`` are not
        freed yet: vLLM's scheduler then lets a request that found no room wait for them (a
        step) instead of preempting a running one, whose prefix would be computed again."""
        now = time.perf_counter()
        for req_id in [req_id for req_id in self._deadlines if req_id not in self._retained]:
            del self._deadlines[req_id]
        return any(
            0.0 <= now - deadline <= PENDING_FREE_SECONDS for deadline in self._deadlines.values()
        )

    def shutdown(self) -> None:
        if self._reporter is not None:
            self._reporter.close(timeout=self._settings.report_timeout_seconds)
        super().shutdown()

    def _retain(
        self, request: Request, params: dict[str, Any], request_params: dict[str, Any]
    ) -> bool:
        """Set the retention upstream just scheduled with one TTL; True if blocks stay held."""
        req_id = request.request_id
        seconds = (
            0.0  # a release request is plumbing: nothing of it is worth keeping
            if wire.is_housekeeping(request_params)
            else retention_seconds(
                request_params,
                default=self._settings.default_retention_seconds,
                maximum=self._settings.max_retention_seconds,
            )
        )
        now = time.perf_counter()
        params[wire.EXPIRES_IN_SECONDS] = seconds
        params[wire.EXPIRES_AT] = time.time() + seconds
        # Upstream's own expiry field, which P's worker checks before reading: an already
        # past deadline makes P decline (and recompute) instead of reading freed blocks.
        params[wire.REMOTE_BLOCKS_EXPIRY_TIME] = now + seconds
        if seconds == 0:
            self._reqs_need_send.pop(req_id, None)
            self._reqs_not_processed.add(req_id)
            return False
        self._reqs_need_send[req_id] = self._deadlines[req_id] = now + seconds
        # Upstream's worker tracks a deadline only for requests it saw in a transfer batch;
        # a decode request that pulled nothing (its prompt was sent to D directly) would
        # otherwise keep its blocks forever. Announcing it again is harmless.
        self._reqs_in_batch.add(req_id)
        self._retained.add(req_id)
        held_tokens = request.all_token_ids[: params.get(wire.REMOTE_NUM_TOKENS) or 0]
        params.update(PrefixFingerprint.of(held_tokens, self.block_size).to_params())
        params.update(self._capacity)
        return True

    def _renew(self, req_id: str, seconds: float) -> None:
        """Keep a retained request's blocks at least ``seconds`` from now (within the maximum
        retention); the worker takes the later deadline on its next step. One already released
        or expired stays so: its blocks may be freed already."""
        now = time.perf_counter()
        deadline = self._deadlines.get(req_id, 0.0)
        if req_id not in self._retained or deadline <= now:
            logger.debug("Renewal of %s ignored: no blocks retained for it", req_id)
            return
        renewed = now + min(seconds, self._settings.max_retention_seconds)
        if renewed > deadline:
            self._reqs_need_send[req_id] = self._deadlines[req_id] = renewed

    def _release(self, req_id: str) -> None:
        """Expire a retained request now; the worker frees its blocks on its next step."""
        if req_id not in self._retained:
            logger.debug("Release of %s ignored: no blocks retained for it", req_id)
            return
        self._reqs_need_send[req_id] = self._deadlines[req_id] = time.perf_counter()


@dataclass
class _Load:
    """A request's load from a remote engine; ``outcome`` None while it runs.

    A synchronous load names the blocks it reads (``sync_blocks``), by which the worker reports
    a failure, and is ``dispatched`` once it is in a step's metadata.
    """

    engine_id: str
    outcome: str | None = None
    sync_blocks: frozenset[int] | None = None
    dispatched: bool = False


def _idle_backoff(settings: ConnectorSettings) -> IdleBackoff:
    """Long idle waits where new requests can cut them short, short sleeps elsewhere."""
    requests = engine_input_queue()
    if requests is None:
        logger.info("Engine core's request queue not found: idle steps sleep %.0f ms at most",
                    1000 * settings.idle_sleep_seconds)  # fmt: skip
        return IdleBackoff(
            grace_seconds=settings.idle_grace_seconds, sleep_seconds=settings.idle_sleep_seconds
        )
    return IdleBackoff(
        grace_seconds=settings.idle_grace_seconds,
        sleep_seconds=settings.idle_sleep_seconds,
        max_wait_seconds=settings.idle_max_wait_seconds,
        sleep=functools.partial(wait_for_input, requests),
    )


def _pulls_holding(params: dict[str, Any] | None) -> bool:
    """True for a prefill request that names a decode engine's retained blocks."""
    return bool(
        params
        and params.get(wire.DO_REMOTE_DECODE)
        and params.get(wire.REMOTE_BLOCK_IDS)
        and params.get(wire.REMOTE_ENGINE_ID)
    )


def _clip_remote_blocks(params: dict[str, Any], *, loaded_tokens: int) -> None:
    """Keep only the held blocks that cover the first ``loaded_tokens`` tokens.

    Upstream aligns remote and local block lists at their *ends* (to skip blocks P already
    has), which is right only when the lists cover the same tokens: a holding longer than
    what P loads would otherwise be read from its tail.
    """
    block_size = int(params.get(wire.HASH_BLOCK_SIZE) or 0)
    if block_size < 1:
        return
    keep = cdiv(loaded_tokens, block_size)
    params[wire.REMOTE_BLOCK_IDS] = [list(group)[:keep] for group in params[wire.REMOTE_BLOCK_IDS]]
