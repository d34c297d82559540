"""Reuse policies: where a session's turn runs (local / pull / recompute), and retention after.

``agentkv`` (:class:`CostModelPolicy`) predicts each path's time to first token from rates the
router measures on its own steps (exponentially weighted line fits): continuing on the decode
holder (``local``: the holder prefills only the turn's new tokens), pulling the held tokens to a
prefill engine, or recomputing them there. Both sides of a busy holder are priced: ``local``
must save the turn more seconds than it adds to the holder's other sequences together, and
keep the delay it adds to each of their steps within a budget (settings.LocalPathSettings)
unless P's queue would cost the turn more than that; a pull's time is learned apart for busy
holders, whose reads wait for their decode steps, and what its read costs their sequences is
added to it. Holdings that would expire first are not used. It asks decode engines to retain
KV for as long as the client's hints say the next turn is away.
``upstream`` imitates vLLM's example proxy (a fixed 64-token threshold, the engines' fixed
480 s retention, no hints), ``upstream-best`` the same proxy once
streamed turns report their holdings, and ``never`` always recomputes and asks engines to keep
nothing: the benchmark's modes ``upstream``, ``upstream-best`` and ``recompute``. ``always``
pulls every holding that will not expire first, whatever it costs (retention as ``agentkv``):
for tests of the KV path, and for operators who know pulling wins on their hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agentkv_server.router.fit import LinearFit
from agentkv_server.router.sessions import Holding
from agentkv_server.router.turn import KVPath, TurnHints
from agentkv_server.settings import (
    CostModelSettings,
    LocalPathSettings,
    PolicyName,
    RetentionSettings,
    Settings,
)

__all__ = [
    "HOST_TIER",
    "HOST_TIER_OVER_BUDGET",
    "LOCAL_OVER_BUDGET",
    "LOCAL_SLOWS_OTHERS",
    "PULL_SLOWS_OTHERS",
    "TAIL_OVER_BUDGET",
    "AlwaysPolicy",
    "CostModelPolicy",
    "Decision",
    "LocalEstimate",
    "NeverPolicy",
    "PrefillSample",
    "ReusePolicy",
    "TurnLoad",
    "UpstreamBestPolicy",
    "UpstreamPolicy",
    "make_policy",
]

LOCAL_OVER_BUDGET = "local_over_budget"
"""The reason of a local turn over the stall budget whose wait behind P's queue would cost it
more seconds than its slices add to the holder's running sequences together
(``CostModelPolicy.others_delay_s``)."""
PULL_SLOWS_OTHERS = "pull_slows_others"
"""The reason of a recompute where the pull, though predicted faster, would cost it fewer
seconds than its read adds to the holder's running sequences together."""
LOCAL_SLOWS_OTHERS = "local_slows_others"
"""The reason of a pull or a recompute where the local path, though within the stall budget
and predicted faster, saves the turn fewer seconds than its slices add to the holder's running
sequences together."""
TAIL_OVER_BUDGET = "tail_over_budget"
"""The reason of a pull or a recompute where the local path's slices would take the share of
the holder's recent gaps that ran beside a local prefill past ``local.max_slowed_share``: the
decoders' TPOT p99 would move, whatever P's queue."""
HOST_TIER = "host_tier"
"""The reason of a local turn whose history comes back from its engine's host tier."""
HOST_TIER_OVER_BUDGET = "host_tier_over_budget"
"""The same, over the stall budget, as ``LOCAL_OVER_BUDGET``."""


@dataclass(frozen=True)
class Decision:
    """Where a turn with a holding runs, and why (a reason label for logs and tests)."""

    path: KVPath
    """``LOCAL``, ``PULL`` or ``RECOMPUTE``."""
    reason: str
    added_itl_s: float | None = None
    """For ``local``: the inter-token delay predicted for the holder's running sequences per
    decode step (0 on an idle holder); None for the other paths."""

    @property
    def reuse(self) -> bool:
        """Whether a prefill engine pulls the holding."""
        return self.path is KVPath.PULL


@dataclass(frozen=True)
class TurnLoad:
    """What the local path's choice needs beyond the holding.

    ``new_tokens``: the prompt's tokens beyond the holding; ``holder_running``: requests the
    router has in flight on the holder (the sequences a local prefill would stall);
    ``holder_added_s``: what a local prefill of this turn's prompt adds to each of the
    holder's decode steps, as its streams showed it (placement.StepTimes; None until seen);
    ``prefill_wait_s``: how long a prefill step would wait behind those in flight on the least
    busy prefill engine; ``read_delay_s``: what a pull of the holding adds to each of the
    holder's running sequences over its P step in all, as its streams showed it during earlier
    pulls (placement.StepTimes; None until seen); ``slowed_gaps``: of the holder's last
    ``window_gaps`` stream gaps, those that ran beside a local prefill (``window_gaps`` None:
    not counted, and no share to keep); ``prefill_sharing``: the turns in flight on that
    engine or held for it, which a longer step there (a recompute rather than a pull)
    delays.
    """

    new_tokens: int
    holder_running: int
    holder_added_s: float | None = None
    prefill_wait_s: float = 0.0
    read_delay_s: float | None = None
    slowed_gaps: int = 0
    window_gaps: int | None = None
    prefill_sharing: int = 0

    @property
    def holder_busy(self) -> bool:
        return self.holder_running > 0


@dataclass(frozen=True)
class LocalEstimate:
    """The local path's predicted time to first token, and the inter-token delay it adds to
    each decode step of the holder's running sequences (0 on an idle holder)."""

    seconds: float
    added_itl_s: float
    measured: bool = True
    """Whether ``added_itl_s`` is what the holder's streams showed; False: the bound of a
    slice's prefill time, which overstates a sliced step's cost."""


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill step: tokens computed, tokens pulled from a holder, its service
    seconds, and whether the holder was decoding other sequences (its reads then wait for its
    steps).

    Service, not the step's whole time: its wait behind other prompts on P is the queue's,
    which :meth:`CostModelPolicy.decide` adds apart (``TurnLoad.prefill_wait_s``); counted
    twice, it became a fixed cost of every P step (docs/router.md, "Reuse policies")."""

    computed_tokens: int
    pulled_tokens: int
    seconds: float
    holder_busy: bool = False


class ReusePolicy(Protocol):
    name: PolicyName
    sends_hints: bool
    """Whether decode engines get agentkv's own ``kv_transfer_params`` (retention, ticket,
    release). False for engines that only speak upstream's protocol."""
    considers_local: bool
    """Whether :meth:`decide` may choose ``local`` (then the router counts new tokens)."""
    manages_capacity: bool
    """Whether the router keeps this policy's holdings within each decode engine's budget
    (capacity.py). vLLM's proxy, which the upstream policies imitate, has nothing of the kind."""

    def decide(self, holding: Holding, now: float, load: TurnLoad | None = None) -> Decision:
        """``load`` None: the new part is unknown, so the turn cannot go ``local``."""

    def decide_from_host_tier(self, held_tokens: int, load: TurnLoad) -> Decision:
        """A turn whose holding of ``held_tokens`` went to make room, its KV now in the holder's
        host tier: ``local`` (the holder loads it back) or ``recompute``; never a pull."""

    def retention_s(self, hints: TurnHints) -> float:
        """Seconds the decode engine should keep this turn's KV after it finishes."""

    def observe(self, sample: PrefillSample) -> None: ...

    def observe_local(self, new_tokens: int, seconds: float, holder_busy: bool = False) -> None:
        """A local turn's new tokens and its decode step's time to first byte; ``holder_busy``:
        the holder was decoding other sequences (the prefill went in slices)."""

    def observe_handoff(self, seconds: float) -> None:
        """A decode step's time to first byte after a prefill step (reading P's new blocks)."""


class CostModelPolicy:
    """The path with the least predicted time to first token, within the holder's TPOT budget
    (or over it, when that pays), where a local turn on a busy holder must also save itself
    more seconds than it adds to the holder's running sequences (:meth:`others_delay_s`).

    Prefill steps that pulled nothing fit ``seconds = fixed + per_token * computed``; steps that
    pulled fit the rest of their time, ``seconds - fixed - per_token * computed``, as
    ``overhead + per_pulled_token * pulled``, apart for idle and busy holders (a busy holder
    serves the read between its decode steps). Local turns on an idle holder fit their decode
    step's time to first byte against their new tokens; on a busy holder, where the prefill goes
    in slices of ``slice_tokens``, against their number of slices. ``handoff`` is the running
    mean of a decode step's time to first byte after a prefill step. Predicted, for H held and
    N new tokens:

    - local, idle holder: ``local(N)``;
    - local, busy holder: ``sliced(ceil(N / slice))``, and every decode step of the holder's
      running sequences slowed by what a slice adds there, as its streams showed it (until
      they have: at most the slice's prefill, ``local_per_token * min(N, slice)``): the delay
      the TPOT budget (``max_stall_s``) bounds;
    - pull: ``fixed + pull(H) + per_token * N``;
    - recompute: ``fixed + per_token * (H + N)``.

    Pull and recompute are compared as they are (both then pay the handoff, and both wait
    behind the prompts in flight on P); local is compared with them plus the handoff and that
    wait, since its own measurement already ends at the first byte and it needs no P.
    """

    name: PolicyName = "agentkv"
    sends_hints = True
    manages_capacity = True

    def __init__(
        self,
        cost: CostModelSettings,
        retention: RetentionSettings,
        local: LocalPathSettings | None = None,
    ) -> None:
        self._cost = cost
        self._retention = retention
        self._local_settings = local or LocalPathSettings()
        self._prefill = LinearFit(0.0, 1.0 / cost.prefill_tokens_per_s, cost.ewma_alpha)
        self._pull = LinearFit(cost.pull_overhead_s, 1.0 / cost.pull_tokens_per_s, cost.ewma_alpha)
        # Until measured, a busy holder's pull is predicted as an idle one's, a local turn on an
        # idle holder at P's rate, and one on a busy holder from its slices (predicted_local).
        self._busy_pull: LinearFit | None = None
        self._local: LinearFit | None = None
        self._sliced: LinearFit | None = None
        self._handoff: float | None = None  # until measured: as if D answered at once after P

    @property
    def considers_local(self) -> bool:
        return self._local_settings.enabled

    @property
    def prefill_s_per_token(self) -> float:
        return self._prefill.line()[1]

    def predicted_pull_s(self, tokens: int, holder_busy: bool = False) -> float:
        fit = self._busy_pull if holder_busy and self._busy_pull is not None else self._pull
        overhead, per_token = fit.line()
        return overhead + tokens * per_token

    def predicted_recompute_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    @property
    def handoff_s(self) -> float:
        """What a pull or a recompute pays after its prefill step: D's time to first byte."""
        return self._handoff or 0.0

    def predicted_local_s(self, new_tokens: int) -> float:
        """The local path's time to first byte on an idle holder (the new part in one step)."""
        if self._local is None:
            return new_tokens * self.prefill_s_per_token
        fixed, per_token = self._local.line()
        return fixed + new_tokens * per_token

    def slices(self, new_tokens: int) -> int:
        """Decode steps a busy holder takes to prefill ``new_tokens`` (at least one)."""
        size = self._local_settings.slice_tokens
        if size == 0 or new_tokens <= size:
            return 1
        return -(-new_tokens // size)

    def predicted_local(self, load: TurnLoad) -> LocalEstimate:
        """The local path's time to first byte and the delay it adds to the holder's steps."""
        new = load.new_tokens
        if not load.holder_busy:
            return LocalEstimate(self.predicted_local_s(new), 0.0)
        added = self._slice_s(new, load.holder_added_s)
        measured = load.holder_added_s is not None or self._local_settings.slice_tokens == 0
        if self._sliced is None:  # each slice rides on one of the holder's decode steps
            return LocalEstimate(self.slices(new) * (self.handoff_s + added), added, measured)
        fixed, per_slice = self._sliced.line()
        return LocalEstimate(fixed + self.slices(new) * per_slice, added, measured)

    def _slice_s(self, new_tokens: int, measured_s: float | None = None) -> float:
        """What one slice of the new part adds to a decode step of the holder: as its streams
        showed it for a whole slice (scaled to a shorter part), else the slice's prefill time
        at the local rate (an upper bound: a step's decodes and its prefill share the work of
        reading the weights; measured 80-190 ms against a bound of ~250 ms for 64 tokens on the
        CPU stack, docs/router.md)."""
        size = self._local_settings.slice_tokens or new_tokens
        if measured_s is not None and size > 0:
            return measured_s * min(new_tokens, size) / size
        per_token = self._local.line()[1] if self._local is not None else self.prefill_s_per_token
        return min(new_tokens, size) * per_token

    def decide(self, holding: Holding, now: float, load: TurnLoad | None = None) -> Decision:
        remaining_s = holding.remaining_s(now)
        if remaining_s < self._cost.expiry_guard_s:
            return Decision(KVPath.RECOMPUTE, "expiring")
        held = holding.num_tokens
        new = load.new_tokens if load is not None else 0
        wait_s = load.prefill_wait_s if load is not None else 0.0
        read_s = self.predicted_pull_s(held, load is not None and load.holder_busy)
        fixed = self._prefill.line()[0]
        pull_s = fixed + read_s + self.predicted_recompute_s(new)
        pull_cost_s = pull_s + self.read_others_delay_s(load)
        recompute_s = fixed + self.predicted_recompute_s(held + new)
        recompute_cost_s = recompute_s + self.recompute_others_delay_s(held, new, load)
        refused = None
        if load is not None and self._local_settings.enabled:
            local = self.predicted_local(load)
            refused = self._local_refusal(load, local)
            on_prefill_s = min(pull_cost_s, recompute_s) + wait_s + self.handoff_s
            saved_s = on_prefill_s - local.seconds
            others_s = self.others_delay_s(load, local)
            if refused is None:
                if saved_s >= others_s:
                    return Decision(KVPath.LOCAL, "local_fastest", local.added_itl_s)
                if saved_s >= 0:
                    refused = LOCAL_SLOWS_OTHERS
            # Over the budget only P's queue is held against it: a pull computes the new part
            # alone, which on its own costs about what the sliced local turn does.
            elif refused == "stall_over_budget" and min(saved_s, wait_s) > others_s:
                return Decision(KVPath.LOCAL, LOCAL_OVER_BUDGET, local.added_itl_s)
        # The pull reads the holding once P gets to it: it must still be there then.
        if remaining_s < wait_s + read_s + self._cost.expiry_guard_s:
            return Decision(KVPath.RECOMPUTE, "expiring")
        if pull_cost_s >= recompute_cost_s:
            cheaper = PULL_SLOWS_OTHERS if pull_s < recompute_s else "recompute_cheaper"
            return Decision(KVPath.RECOMPUTE, refused or cheaper)
        return Decision(KVPath.PULL, refused or "pull_cheaper")

    def recompute_others_delay_s(self, held: int, new: int, load: TurnLoad | None) -> float:
        """The seconds a recompute adds to the turns sharing its prefill engine together: its
        step computes the history a pull would read, and each turn in flight there or held for
        it waits that much longer. Left out, a pull from a busy holder (its read priced against
        the holder's running sequences) lost to a recompute exactly when P was the bottleneck:
        on the overload preset the follow-ups that recomputed at 2x and 4x (5) took 8-14 s to
        their first token, where pulls took 1-6 s (docs/benchmarks.md, "Overload")."""
        if load is None or not load.prefill_sharing:
            return 0.0
        history_s = self.predicted_recompute_s(held + new) - self.predicted_recompute_s(new)
        return history_s * load.prefill_sharing

    def decide_from_host_tier(self, held_tokens: int, load: TurnLoad) -> Decision:
        """Local when predicted faster than recomputing the whole history on P by more than
        its slices add to the holder's running sequences (:meth:`others_delay_s`), over the
        stall budget too. Loading the history back is a memory copy (host to device on a GPU),
        left out of the estimate: 4 ms for 1,280 tokens of the tiny model on the CPU stack
        (docs/router.md, "Capacity")."""
        if not self._local_settings.enabled:
            return Decision(KVPath.RECOMPUTE, "local_disabled")
        local = self.predicted_local(load)
        refused = self._local_refusal(load, local)
        recompute_s = self._prefill.line()[0] + self.predicted_recompute_s(
            held_tokens + load.new_tokens
        )
        on_prefill_s = recompute_s + load.prefill_wait_s + self.handoff_s
        if local.seconds > on_prefill_s:
            return Decision(KVPath.RECOMPUTE, "recompute_cheaper")
        # The whole history is what P would compute: held against the budget, like a queue.
        if on_prefill_s - local.seconds < self.others_delay_s(load, local):
            return Decision(KVPath.RECOMPUTE, refused or LOCAL_SLOWS_OTHERS)
        if refused is None:
            return Decision(KVPath.LOCAL, HOST_TIER, local.added_itl_s)
        if refused == "stall_over_budget":
            return Decision(KVPath.LOCAL, HOST_TIER_OVER_BUDGET, local.added_itl_s)
        return Decision(KVPath.RECOMPUTE, refused)

    def others_delay_s(self, load: TurnLoad, local: LocalEstimate) -> float:
        """The seconds a local turn's slices add to the holder's running sequences together
        (added delay per step x slices x running sequences): what the turn must save itself,
        within the stall budget or over it, to go local. A second of another session's wait
        counts as one of this turn's.

        The budget bounds what one decode step may be slowed by; it knows neither what the
        turn saves nor how many sequences pay. Over it, P's queue of cold first turns held
        pulls for 5.8-13.8 s on the pressure preset, where a local turn took ~1 s and slowed
        each of two or three running sequences by a few tenths of a second for three steps.

        A cost the holder's streams have not shown yet is priced at its bound, the slice's
        whole prefill time per step, which overstates it: such a turn goes local only where it
        saves even that (behind P's queue), and its slices are measured then. Counted as
        nothing, it sent one follow-up per router and history to its busy holder whatever P's
        queue: on the two-decoder bench, in each repeat of three runs, the first session's
        fourth turn at 4k tokens went local with P idle (1.46-1.81 s, where pulls took a
        median 1.50-1.64 s), and both decoders' steps took 0.4-0.6 s for three steps where
        plain ones took 0.09-0.1 s: 12 of the 28 gaps in their slowest 1% at 4k in the last
        run (docs/router.md, "Three paths")."""
        return local.added_itl_s * self.slices(load.new_tokens) * load.holder_running

    @staticmethod
    def read_others_delay_s(load: TurnLoad | None) -> float:
        """The seconds a pull's read adds to the holder's running sequences together: a busy
        holder serves it between its decode steps. Nothing until its streams have shown it
        beside a pull. Measured after each engine's core was pinned with its engine: 0 and 1
        of 555 and 667 decoder gaps beside a pull were slow (docs/benchmarks.md); before, 20
        of 809, when the holder's spinning engine core took P's core."""
        if load is None or load.read_delay_s is None:
            return 0.0
        return load.read_delay_s * load.holder_running

    def _local_refusal(self, load: TurnLoad, local: LocalEstimate) -> str | None:
        """Why the local path would hurt the holder's other sessions, or None."""
        limits = self._local_settings
        if load.new_tokens > limits.max_new_tokens:
            return "new_part_too_long"
        if self._slows_too_many_gaps(load):
            return TAIL_OVER_BUDGET
        # A sliced prefill whose cost the holder's streams have not shown yet is not held to
        # the budget at its bound, which overstates it: only a local turn beside running
        # sequences measures it (priced at the bound all the same: others_delay_s).
        if local.measured and local.added_itl_s > limits.max_stall_s:
            return "stall_over_budget"
        return None

    def _slows_too_many_gaps(self, load: TurnLoad) -> bool:
        """Whether the turn's slices, one gap of each running sequence per slice, would take
        the holder's recent gaps beside a local prefill past ``max_slowed_share`` of them.

        The stall budget bounds how slow such a gap is, not how many there are, and the over-
        budget rule lets P's queue outweigh it: beside four agent sessions, whose cold first
        turns kept P's queue seconds long, 34 of 72 follow-ups went local and slowed 98 of the
        two decoders' 5427 gaps (1.8 %); the decoders' TPOT p99 was 250 ms, 112 ms
        without them (docs/benchmarks.md, "Two decoders, four agent sessions"). A p99 moves
        only once more than 1 % of the gaps are slow."""
        if load.window_gaps is None or not load.holder_busy:
            return False
        slowed = load.slowed_gaps + self.slices(load.new_tokens) * load.holder_running
        return slowed > self._local_settings.max_slowed_share * load.window_gaps

    def retention_s(self, hints: TurnHints) -> float:
        retention = self._retention
        if hints.session_end:
            return 0.0
        if hints.next_turn_seconds is None:
            return retention.default_s
        asked = hints.next_turn_seconds * retention.factor + retention.slack_s
        return min(max(asked, retention.min_s), retention.max_s)

    def observe(self, sample: PrefillSample) -> None:
        floor = self._cost.min_sample_tokens
        if sample.pulled_tokens == 0 and sample.computed_tokens >= floor:
            self._prefill.add(sample.computed_tokens, sample.seconds)
        elif sample.pulled_tokens >= floor:
            fixed, per_token = self._prefill.line()
            pull_s = sample.seconds - fixed - per_token * sample.computed_tokens
            self._pull_fit(sample.holder_busy).add(sample.pulled_tokens, max(pull_s, 0.0))

    def _pull_fit(self, holder_busy: bool) -> LinearFit:
        if not holder_busy:
            return self._pull
        if self._busy_pull is None:
            self._busy_pull = LinearFit(*self._pull.line(), self._cost.ewma_alpha)
        return self._busy_pull

    def observe_local(self, new_tokens: int, seconds: float, holder_busy: bool = False) -> None:
        alpha = self._cost.ewma_alpha
        if holder_busy:
            if self._sliced is None:
                per_slice = self.handoff_s + self._slice_s(new_tokens)
                self._sliced = LinearFit(0.0, per_slice, alpha)
            self._sliced.add(self.slices(new_tokens), seconds)
            return
        if self._local is None:
            self._local = LinearFit(0.0, self.prefill_s_per_token, alpha)
        self._local.add(new_tokens, seconds)

    def observe_handoff(self, seconds: float) -> None:
        if self._handoff is None:
            self._handoff = seconds
        else:
            self._handoff += self._cost.ewma_alpha * (seconds - self._handoff)


class AlwaysPolicy(CostModelPolicy):
    """Pull every holding that outlives the expiry guard; retain as the cost model does."""

    name: PolicyName = "always"
    considers_local = False  # type: ignore[assignment]

    def decide(self, holding: Holding, now: float, load: TurnLoad | None = None) -> Decision:
        if holding.remaining_s(now) < self._cost.expiry_guard_s:
            return Decision(KVPath.RECOMPUTE, "expiring")
        return Decision(KVPath.PULL, "always")


class _FixedPolicy:
    """A policy that learns nothing from the turns it sees."""

    def decide_from_host_tier(self, held_tokens: int, load: TurnLoad) -> Decision:
        """Never reached: these policies release nothing for room (``manages_capacity``)."""
        return Decision(KVPath.RECOMPUTE, "disabled")

    def observe(self, sample: PrefillSample) -> None:
        return None

    def observe_local(self, new_tokens: int, seconds: float, holder_busy: bool = False) -> None:
        return None

    def observe_handoff(self, seconds: float) -> None:
        return None


class UpstreamPolicy(_FixedPolicy):
    """vLLM's example proxy: reuse from 64 held tokens, engines keep KV their fixed 480 s."""

    name: PolicyName = "upstream"
    sends_hints = False
    considers_local = False
    manages_capacity = False
    THRESHOLD_TOKENS = 64
    RETENTION_S = 480.0

    def decide(self, holding: Holding, now: float, load: TurnLoad | None = None) -> Decision:
        if holding.num_tokens < self.THRESHOLD_TOKENS:
            return Decision(KVPath.RECOMPUTE, "below_threshold")
        return Decision(KVPath.PULL, "threshold")

    def retention_s(self, hints: TurnHints) -> float:
        return self.RETENTION_S


class UpstreamBestPolicy(UpstreamPolicy):
    """vLLM's example proxy once streamed turns report their params: the same threshold and
    fixed retention, but each decode step carries a ticket, so a streamed turn's holding reaches
    the router as a non-streamed one's does. The retention it sends is the engines' fixed 480 s
    whatever the client hints, and nothing is released for capacity, so the ticket changes what
    is learned, not what is kept."""

    name: PolicyName = "upstream-best"
    sends_hints = True


class NeverPolicy(_FixedPolicy):
    """Always recompute, and ask engines to free each turn's KV at once."""

    name: PolicyName = "never"
    sends_hints = True
    considers_local = False
    manages_capacity = False  # it keeps nothing

    def decide(self, holding: Holding, now: float, load: TurnLoad | None = None) -> Decision:
        return Decision(KVPath.RECOMPUTE, "disabled")

    def retention_s(self, hints: TurnHints) -> float:
        return 0.0


def make_policy(settings: Settings) -> ReusePolicy:
    """The policy the settings name."""
    if settings.policy == "upstream":
        return UpstreamPolicy()
    if settings.policy == "upstream-best":
        return UpstreamBestPolicy()
    if settings.policy == "never":
        return NeverPolicy()
    if settings.policy == "always":
        return AlwaysPolicy(settings.cost, settings.retention)
    return CostModelPolicy(settings.cost, settings.retention, settings.local)
