"""Scheduler-side vToken: one token table per request, driving vLLM's block allocation.

Lives in the engine-core process beside vLLM's ``KVCacheManager`` (installed by
``workers/vllm_patches.py``). vLLM's per-request block list (``req_to_blocks[id]``) *is*
the token table's ``block_ids``: the physical count (``table.num_slots``) decides how many
blocks a request needs, while ``request.num_computed_tokens`` stays logical.

Per step (synchronous scheduling)::

    schedule()            allocate(): table.append(new tokens), blocks from vLLM's pool
                          take_ops(): last step's repack moves + truncations + offsets
                                      -> SchedulerOutput.vtoken_ops
    worker                repack, truncate rows, forward with physical seq_lens/slots,
                          attention statistics -> ModelRunnerOutput.vtoken_scores
    update_from_output()  after_step(): policy evicts, plan_repack, commit the table,
                          emptied blocks back to the pool

Emptied blocks return to the pool when the repack is committed, before its copies ran on
the worker: safe because the worker applies the copies before the next forward, and a
block given to another request is written only by that forward or later (stream order).
Async scheduling (an in-flight step could still read such a block) is refused at start.

Where the policy runs: here, in the engine core. It owns the token tables and the block
pool, so a decision, its repack plan and the frees happen in one place with no second copy
of the tables to keep consistent. The worker computes only what needs the KV cache and
the captured queries (``[n_live]`` floats per scored request and step; window rows or
per-head sums for the policies that ask) and returns them on the ``ModelRunnerOutput``.
With tensor parallelism only the driver worker's output comes back, so scores would cover
its heads only (not supported yet: this build is single-worker CPU).

``naive`` mode (Naive-Evict): the same decisions and the same physical compaction (so
attention is identical); the manager also holds *ballast* blocks from the pool, so a
request holds what a block-granular manager would (``vtoken/manager.py``).

Prefix caching (vLLM's ``enable_prefix_caching``) works beside eviction by one rule: a
block is in the prefix cache only while it holds what its hash says. vLLM hashes a block
by the logical tokens it held when full and publishes it when allocated; eviction empties
slots and a repack moves tokens across blocks. So, per request:

- a request publishes every full block, as vanilla vLLM does, until it first evicts (a
  policy that never evicts, ``none``, never stops); one evicting on demand publishes
  everything while memory does not bind;
- when it evicts, every published block from the first one the eviction and its repack
  touch (the block of its lowest emptied slot: the repack fills holes below the live
  count from tokens above it, so nothing below that block moves) leaves the cache first
  (its hash is dropped), and the request publishes nothing past that point again;
- its *protected* prefix is never evicted: its first ``prefix_pin_tokens`` (the engine's
  config: a tenant's system prompt stays cacheable however hard the request is
  squeezed) and, at each eviction, every block another request holds too (reference
  count > 1: a block it took from a cache hit while its first holder still runs, or one
  of its own that a later request took). They join its policy's sinks for that
  eviction, so no eviction or repack writes a block another request reads, and no hit
  ever reads a block that changed. A block it took from the cache that nobody else holds
  any more is its own: evicting in it unpublishes it like any other, unless the engine
  pins cache hits (``pin_cache_hits``: they stay protected and cached for the request's
  life, outside its policy's budget; not for a resumed request, whose hit is its own
  sequence, nor under a hard bound). (vLLM itself drops a cached block's hash when it hands the
  block out again.)
- a shared block is charged once, to its earliest current holder
  (``VTokenManager.charged_elsewhere``); the others count it neither against their
  budget nor against ``hold_blocks`` (a request's budget is in the tokens it pays for).
  With ``pin_cache_hits`` a request keeps its cache hit on top of its policy's budget,
  unless a hard bound applies to it (``hold_blocks``, a tenant's cap, pressure).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.intmath import cdiv
from vtoken.manager import RequestKV, VTokenManager
from vtoken.policy import ScoreNeeds, StepAttention
from vtoken.repack_planner import ReclaimMode
from vtoken.reports import DEFAULT_TENANT, EngineReport, RequestReport
from workers.config import HOLD_TO_BLOCKS_KEY, PolicySpec, VTokenConfig, request_policy_spec
from workers.messages import StepOps, StepScores
from workers.vllm_block_pool import VLLMBlockPool

MAX_FINISHED_RECORDS = 4096
STEP_WINDOW_S = 2.0  # reports carry the longest steps that ended this recently
RECENT_STEPS = 16  # how many of them
_EMPTY = np.zeros(0, dtype=np.int64)


def _ends_with_this_step(request: Any) -> bool:
    """Whether a decoding vLLM ``Request`` reaches its ``max_tokens`` with the token this
    step samples (vLLM's stop check runs after the vToken step hook). Stop tokens and
    strings are not foreseen: such a request counts as going on."""
    max_tokens = getattr(request, "max_tokens", None)
    num_output = getattr(request, "num_output_tokens", None)
    if not isinstance(max_tokens, int) or not isinstance(num_output, int):
        return False
    if getattr(request, "resumable", False):
        return False  # a streaming-input request keeps its blocks for its next input
    decoding = request.num_computed_tokens >= request.num_tokens
    return decoding and num_output + 1 >= max_tokens


@dataclass(slots=True)
class ScheduledRequest:
    """One running request of the engine core: the manager's entry, its policy spec, what
    the workers still have to apply (repack moves, the block count after the repack), and
    every step's evicted logical ids when ``record_evictions`` is on."""

    kv: RequestKV
    spec: PolicySpec
    capped: bool = False  # its spec is a per-request override (the tenant's cap)
    protected: int = 0  # leading tokens its policy may not evict now (pin, shared blocks)
    cacheable: int | None = None  # tokens it may publish; None: every full block
    base_sinks: int = 0  # its policy's own sinks
    shared_elsewhere: int = 0  # blocks it holds that another request pays for (this step)
    hit_tokens: int = 0  # tokens it took from a prefix-cache hit
    hold_blocks: int | None = None  # what admission counts it at once its prefill ended
    pressure_anchor: int | None = None  # live tokens when its tenant's pressure reached it
    pending_src: np.ndarray = field(default_factory=lambda: _EMPTY)
    pending_dst: np.ndarray = field(default_factory=lambda: _EMPTY)
    pending_num_blocks: int | None = None
    evictions: list[np.ndarray] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A finished request's last report and (``record_evictions``) its evictions."""

    report: RequestReport
    evictions: list[np.ndarray]


def _hold_blocks(extra: Mapping[str, Any]) -> int | None:
    """The request's ``HOLD_TO_BLOCKS_KEY`` (a positive int), else ``None``."""
    value = extra.get(HOLD_TO_BLOCKS_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


class StepTimes:
    """How long the engine's recent steps took: from vLLM's ``schedule`` to the end of its
    ``update_from_output`` (the policies, the repack plan and vLLM's own update included).

    Reports carry the longest steps that ended in the last ``window_s``, each with its end
    on the wall clock: a replica's counters are read between steps, so a tenant's KV can
    run over its budget for a report period plus one step before anything acts, and a
    reader of the reports needs the steps to judge an excursion.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        window_s: float = STEP_WINDOW_S,
    ) -> None:
        self._clock = clock
        self._wall = wall
        self._window_s = window_s
        self._started: float | None = None
        self._recent: deque[tuple[float, float, float]] = deque()  # (ended, wall, duration)

    def begin(self) -> None:
        self._started = self._clock()

    def end(self) -> None:
        if self._started is None:
            return
        now = self._clock()
        self._recent.append((now, self._wall(), now - self._started))
        self._started = None
        self._forget(now)

    def recent_max_s(self) -> float:
        self._forget(self._clock())
        return max((duration for _, _, duration in self._recent), default=0.0)

    def recent_longest(self, count: int = RECENT_STEPS) -> tuple[tuple[float, float], ...]:
        """The ``count`` longest recent steps as ``(ended at, wall clock; seconds)``, in
        time order."""
        self._forget(self._clock())
        longest = sorted(self._recent, key=lambda step: step[2], reverse=True)[:count]
        return tuple((wall, duration) for _, wall, duration in sorted(longest))

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()


class VTokenScheduler:
    """Token tables, policies and block accounting of one engine core.

    ``single_type_manager`` is vLLM's ``FullAttentionManager`` (its ``req_to_blocks`` is
    kept equal to the tables' block ids). Invariants in ``check_invariants``.
    """

    def __init__(
        self,
        config: VTokenConfig,
        block_pool: Any,
        single_type_manager: Any,
        max_step_tokens: int | None = None,
    ) -> None:
        self.config = config
        self.max_step_tokens = max_step_tokens  # vLLM's token budget of one step
        self.pool = VLLMBlockPool(block_pool)
        self.block_size = int(single_type_manager.block_size)
        self.stm = single_type_manager
        self.manager = VTokenManager(self.pool, self.block_size, config.mode)
        self.requests: dict[str, ScheduledRequest] = {}
        self.finished: OrderedDict[str, FinishedRequest] = OrderedDict()
        self.num_preemptions = 0
        # request-steps evicted for room (on_demand) or under controller pressure
        self.num_evictions_under_pressure = 0
        # request-steps evicted to stay within what admission counts (``hold_blocks``)
        self.num_evictions_to_bound = 0
        self.num_evictions_below_budget = 0  # request-steps squeezed under their budgets
        self.pressure: dict[str, float] = {}  # tenant -> keep fraction (the controller's)
        self.allowance: dict[str, int] = {}  # tenant -> most blocks it may hold here
        self.step_times = StepTimes()
        # what the worker's repacks cost since start (its cumulative totals, latest kept)
        self.repack_bytes_total = 0
        self.repack_seconds_total = 0.0

    def manages(self, request_id: str) -> bool:
        return request_id in self.requests

    # ------------------------------------------------------------------ allocation
    def allocate(
        self,
        request: Any,
        num_new_tokens: int,
        reserve: int = 0,
        hit_blocks: Sequence[Any] = (),
    ) -> list[Any] | None:
        """Blocks for ``num_new_tokens`` more tokens of ``request`` (vLLM ``Request``), or
        ``None`` when the pool cannot give them while keeping ``reserve`` blocks free.

        ``hit_blocks``: vLLM's prefix-cache hit for a request not yet started (full
        blocks whose tokens precede the new ones); the request takes a reference on them
        and pins their tokens. On ``None`` nothing was taken."""
        request_id = request.request_id
        if request_id not in self.requests:
            self._add(request)
        record = self.requests[request_id]
        table = record.kv.table
        assert table.num_logical == request.num_computed_tokens, (
            f"{request_id}: table has {table.num_logical} tokens, vLLM computed "
            f"{request.num_computed_tokens}"
        )
        if hit_blocks:
            if table.num_logical:
                raise RuntimeError(f"vToken: a prefix-cache hit for running {request_id}")
            num_hit = len(hit_blocks) * self.block_size
            # A hit block nobody holds sits in vLLM's free queue: taking it uses a free block.
            taken = sum(1 for block in hit_blocks if block.ref_cnt == 0)
            needed = cdiv(num_hit + num_new_tokens, self.block_size) - len(hit_blocks)
            if needed + taken + reserve > self.pool.num_free_blocks:
                return None
            self.pool.share(hit_blocks)
            self.manager.adopt(request_id, [block.block_id for block in hit_blocks])
            self.stm.req_to_blocks[request_id].extend(hit_blocks)
            self.stm.num_cached_block[request_id] = len(hit_blocks)  # published already
            # A resumed request's hit is its own sequence: never pinned (memory is short).
            record.hit_tokens = 0 if getattr(request, "num_preemptions", 0) else num_hit
        block_ids = self.manager.allocate(request_id, num_new_tokens, reserve)
        if block_ids is None:
            assert not hit_blocks, "room was checked with the hit"
            return None
        blocks = self.pool.blocks(block_ids)
        self.stm.req_to_blocks[request_id].extend(blocks)
        if self.stm.records_new_block_ids:
            self.stm.new_block_ids.extend(block_ids)
        return blocks

    def num_cacheable_tokens(self, request_id: str, num_tokens: int) -> int:
        """How many of a request's first ``num_tokens`` tokens may be published to the
        prefix cache (vLLM publishes the full blocks among them): all of them until it
        first evicted, then what lay below its first eviction."""
        cacheable = self.requests[request_id].cacheable
        return num_tokens if cacheable is None else min(num_tokens, cacheable)

    def _protect(self, record: ScheduledRequest, num_tokens: int) -> None:
        """Its policy may not evict the request's first ``num_tokens`` tokens (they join its
        own sinks) until the next call."""
        policy = record.kv.policy
        if policy is None or not policy.evicts:
            return
        record.protected = num_tokens
        policy.sinks = max(record.base_sinks, num_tokens)

    def _protect_shared(self, record: ScheduledRequest) -> None:
        """Before an eviction: protect the pinned prefix and every block another request
        also holds (only published blocks are shared: hits take them from the start)."""
        policy = record.kv.policy
        if policy is None or not policy.evicts:
            return
        request_id = record.kv.request_id
        blocks = self.stm.req_to_blocks[request_id]
        published = min(self.stm.num_cached_block.get(request_id, 0), len(blocks))
        shared = [i for i in range(published) if blocks[i].ref_cnt > 1]
        reach = (shared[-1] + 1) * self.block_size if shared else 0
        self._protect(record, max(self.config.prefix_pin_tokens, reach, self._pinned_hit(record)))

    def _pinned_hit(self, record: ScheduledRequest) -> int:
        """Tokens of its cache hit the request keeps for life (``pin_cache_hits``): none
        under a bound admission or the controller set (``hold_blocks``, a tenant's cap,
        pressure): those bounds come first."""
        if not self.config.pin_cache_hits or record.capped or record.hold_blocks is not None:
            return 0
        return 0 if record.kv.tenant in self.pressure else record.hit_tokens

    def _unpublish_changed(self, record: ScheduledRequest) -> None:
        """After an eviction, before its repack: drop from the prefix cache the published
        blocks from the first one it touches, and publish nothing past it again."""
        table = record.kv.table
        holes = np.flatnonzero(~table.live_mask)  # this step's evictions (repacked before)
        if not holes.size:
            return
        first = int(holes[0]) // self.block_size
        request_id = record.kv.request_id
        published = self.stm.num_cached_block.get(request_id, 0)
        if published > first:
            self.pool.unpublish(table.block_ids[first:published])
            self.stm.num_cached_block[request_id] = first
        if record.cacheable is None or record.cacheable > first * self.block_size:
            record.cacheable = first * self.block_size

    def blocks_needed_for(self, num_tokens: int) -> int:
        """Blocks a fresh request needs for ``num_tokens`` tokens (admission check)."""
        return cdiv(num_tokens, self.block_size)

    def _add(self, request: Any) -> None:
        params = request.sampling_params
        extra = (params.extra_args if params is not None else None) or {}
        tenant = str(extra.get("tenant", DEFAULT_TENANT))
        # A bad override never gets here: the front end and the engine core's add path
        # refuse the request (``workers/vllm_patches.py``, request admission).
        spec = request_policy_spec(extra) or self.config
        kv = self.manager.add_request(
            request.request_id, request.num_prompt_tokens, tenant, spec.make_policy()
        )
        record = ScheduledRequest(
            kv,
            spec,
            capped=spec is not self.config,
            hold_blocks=_hold_blocks(extra),
            base_sinks=kv.policy.sinks if kv.policy is not None else 0,
        )
        self._protect(record, self.config.prefix_pin_tokens)
        self.requests[request.request_id] = record
        self.stm.req_to_blocks[request.request_id]  # defaultdict: create the empty list

    # ------------------------------------------------------------------ steps
    def after_step(
        self,
        num_scheduled_tokens: dict[str, int],
        requests: dict[str, Any],
        scores: StepScores | None,
        num_waiting_blocks: int = 0,
    ) -> None:
        """Run the policies of the requests that ran this step, commit repacks, free blocks.

        ``eager``: every request past its prefill evicts to its budget. ``on_demand``: a
        request only feeds its policy this step's attention, unless memory is needed:
        ``num_waiting_blocks`` (what the head of vLLM's waiting queue needs to start), the
        blocks running prefills still need, and a block for every decoding request whose
        next token opens one, beyond the free blocks; then those whose eviction to budget
        gives the next step the most blocks (:meth:`_room`) evict now, and if the running
        requests' own next step still does not fit, :meth:`below_budget` squeezes them
        under their budgets. Always evicting, in both modes: requests under controller
        pressure (``set_pressure``), requests under a tenant's per-request cap (admission
        counted on it), and policies that decide at one step only.
        """
        attention_of = scores.attention if scores is not None else {}
        if scores is not None:
            self.repack_bytes_total = max(self.repack_bytes_total, scores.repack_bytes_total)
            self.repack_seconds_total = max(self.repack_seconds_total, scores.repack_seconds_total)
        running = [r for r in num_scheduled_tokens if r in self.requests and r in requests]
        decoding = [r for r in running if requests[r].num_computed_tokens >= requests[r].num_tokens]
        for request_id in set(running) - set(decoding):
            # A prefill chunk: the policy sees its attention, nothing can be evicted yet.
            self.manager.observe(request_id, attention_of.get(request_id, StepAttention()))
        for request_id in decoding:
            record = self.requests[request_id]
            if record.kv.tenant in self.pressure and record.pressure_anchor is None:
                record.pressure_anchor = record.kv.table.num_live  # new under pressure
        self._refresh_shared()
        for request_id in decoding:  # what room estimates read (sinks) is this step's
            self._protect_shared(self.requests[request_id])
        always, for_room, below = self._to_squeeze(decoding, requests, num_waiting_blocks)
        for request_id in decoding:
            record = self.requests[request_id]
            attention = attention_of.get(request_id, StepAttention())
            # Not squeezed: a step with a budget of everything it holds (the policy observes
            # and counts the step, nothing is evicted).
            squeeze = request_id in always or request_id in for_room or request_id in below
            budget = self._budget(record) if squeeze else record.kv.table.num_live
            budget = min(budget, below.get(request_id, budget))
            self._protect_shared(record)  # a policy may evict on its own (a fixed window)
            evicted = self.manager.evict(request_id, budget, attention)
            if len(evicted):
                self._unpublish_changed(record)
            under_pressure = request_id in for_room or request_id in below
            if len(evicted) and request_id in below:
                self.num_evictions_below_budget += 1
            if len(evicted) and (under_pressure or record.kv.tenant in self.pressure):
                self.num_evictions_under_pressure += 1
            elif len(evicted) and request_id in always and self._outgrows_hold(record, requests):
                self.num_evictions_to_bound += 1
            if self.config.record_evictions:
                record.evictions.append(evicted)
            self._reclaim(record)
        if self.config.check_invariants:
            self.check_invariants()

    def set_pressure(
        self, pressure: Mapping[str, float], allowance: Mapping[str, int] | None = None
    ) -> None:
        """The controller's eviction pressure: tenant -> keep fraction in (0, 1] of what the
        tenant holds (``controlplane/pressure.py``: budget / measured active KV). Each
        running request of such a tenant may keep that fraction of its *anchor*: its live
        tokens when this fraction reached it (a request still in prefill, or added later,
        is anchored at its first decoding step). The same fraction again changes nothing; a
        new fraction (a new plan measured the tenant still over) applies to what each
        request holds then, so a tenant that stays over is squeezed further, toward what
        its policy protects (sinks, recent window), which eviction never takes. Both
        eviction modes; a tenant left out of ``pressure`` is released.

        ``allowance`` (tenant -> blocks, the plan's ``allowance`` for this replica): the
        most blocks a tenant may hold here. In ``on_demand`` mode a tenant above it has its
        decoding requests evicted to their budgets, most blocks above budget first, until
        it fits, at every step (without waiting for the controller's next plan); a tenant
        left out has no limit here."""
        bad = {tenant: f for tenant, f in pressure.items() if not 0.0 < f <= 1.0}
        if bad:
            raise ValueError(f"keep fractions must be in (0, 1]: {bad}")
        allowance = dict(allowance or {})
        negative = {tenant: b for tenant, b in allowance.items() if int(b) != b or b < 0}
        if negative:
            raise ValueError(f"allowances must be whole blocks >= 0: {negative}")
        self.allowance = {tenant: int(b) for tenant, b in allowance.items()}
        changed = {t for t, f in pressure.items() if f < 1.0 and f != self.pressure.get(t)}
        self.pressure = {t: float(f) for t, f in pressure.items() if f < 1.0}
        for record in self.requests.values():
            tenant, table = record.kv.tenant, record.kv.table
            if tenant not in self.pressure or table.num_logical < record.kv.prompt_len:
                record.pressure_anchor = None  # released, or in prefill: set once it decodes
            elif tenant in changed or record.pressure_anchor is None:
                record.pressure_anchor = table.num_live

    def _refresh_shared(self) -> None:
        """Which blocks each request holds that another pays for (prefix caching only)."""
        elsewhere = self.manager.charged_elsewhere()
        for request_id, record in self.requests.items():
            record.shared_elsewhere = elsewhere.get(request_id, 0)

    def _outgrows_hold(self, record: ScheduledRequest, requests: dict[str, Any]) -> bool:
        """Whether the request would hold more than ``hold_blocks`` of the blocks it pays
        for with the blocks its next step opens (admission's bound counts that step)."""
        if record.hold_blocks is None:
            return False
        paid = record.kv.num_held_blocks - record.shared_elsewhere
        return paid + self._next_step_blocks(record.kv.request_id, requests) > record.hold_blocks

    def _budget(self, record: ScheduledRequest) -> int:
        """Live tokens the request may keep after this step.

        Its policy's budget applies to the tokens it pays for and did not pin: blocks
        another request pays for (shared prefix blocks) and, with ``pin_cache_hits``, its
        cache hit are kept on top of it. Then the hard bounds, on what it pays for: its
        ``hold_blocks`` (what admission counts it at, a block for the step) and its
        tenant's pressure (``fraction x anchor``). The policy still keeps what it protects
        (:meth:`blocks_above_budget` counts it)."""
        unpaid = record.shared_elsewhere * self.block_size
        kept = max(unpaid, self._pinned_hit(record))  # both are prefixes of its table
        budget = record.spec.budget(max(0, record.kv.table.num_logical - kept)) + kept
        if record.hold_blocks is not None:
            budget = min(budget, max(1, (record.hold_blocks - 1) * self.block_size) + unpaid)
        fraction = self.pressure.get(record.kv.tenant)
        if fraction is not None and record.pressure_anchor is not None:
            budget = min(budget, max(1, int(record.pressure_anchor * fraction)) + unpaid)
        return budget

    def _evicts_to_budget(self, record: ScheduledRequest) -> bool:
        """Whether its policy brings it to its budget when asked at any step (``none``
        never evicts, SnapKV and PAGE decide once)."""
        policy = record.kv.policy
        return policy is not None and policy.holds_budget_every_step and policy.needs_budget

    def _to_squeeze(
        self, decoding: list[str], requests: dict[str, Any], num_waiting_blocks: int
    ) -> tuple[set[str], set[str], dict[str, int]]:
        """This step's decoding requests that evict now: ``(always, for room, below)``;
        ``below`` maps a request squeezed under its budget to the live tokens it keeps."""
        if self.config.eviction == "eager":
            return set(decoding), set(), {}
        always = set()
        for request_id in decoding:
            record = self.requests[request_id]
            policy = record.kv.policy
            own_timing = policy is not None and not policy.holds_budget_every_step
            # Admission counts it at ``hold_blocks`` from the end of its prefill: it gives
            # back what lies above that at once, not when memory or its tenant runs short.
            held = self._outgrows_hold(record, requests)
            if own_timing or record.capped or held or record.kv.tenant in self.pressure:
                always.add(request_id)
        # Room is counted for the next step: a request squeezed onto a block boundary opens
        # a block again with its next token, so evicting it there gives nothing back.
        ending = {r for r in decoding if _ends_with_this_step(requests[r])}
        need = (
            num_waiting_blocks
            + self.blocks_needed_next_step(requests)
            - self.pool.num_free_blocks
            - sum(self._blocks_returning(r) for r in ending)
            - sum(self._room(r) for r in always - ending)
        )
        decoding = [r for r in decoding if r not in ending]  # nothing to gain from them
        excess = self._excess_over_allowance(always, ending)
        for_room = self._over_allowance([r for r in decoding if r not in always], excess)
        need -= sum(self._room(r) for r in for_room)
        rest = [r for r in decoding if r not in always | for_room]
        room = {request_id: self._room(request_id) for request_id in rest}
        for request_id in sorted((r for r in rest if room[r] > 0), key=lambda r: -room[r]):
            if need <= 0:
                break
            for_room.add(request_id)
            need -= room[request_id]
        # Only the running requests' own next step, not the waiting queue, squeezes anyone
        # below budget: that is where vLLM would preempt one.
        for request_id in for_room:
            tenant = self.requests[request_id].kv.tenant
            if tenant in excess:
                excess[tenant] -= self.blocks_above_budget(request_id)
        victim = self._likely_victim(requests, ending, always | for_room)
        below = self.below_budget(decoding, need - num_waiting_blocks, excess, victim)
        return always, for_room, below

    def below_budget(
        self,
        decoding: list[str],
        need: int,
        excess: Mapping[str, int] | None = None,
        victim: tuple[str, int] | None = None,
    ) -> dict[str, int]:
        """Decoding requests squeezed under their budgets so that the next step needs
        ``need`` blocks fewer (``on_demand`` with ``squeeze_below_budget``, once every request
        that could give room at its budget does). Block by block, the request that would
        keep the largest share of its own budget gives one up (requests of tenants still
        above their allowance here, ``excess`` in blocks, first), so shares stay level and
        no more is taken than ``need``; a request keeps whatever its remaining blocks hold
        with its next token. None goes under its *floor*: ``squeeze_floor`` of its own
        budget plus the prefix it does not pay for or pinned (and never under what its
        policy protects). Request id -> live tokens it keeps.

        When the floors cannot free ``need`` blocks, vLLM preempts ``victim`` (its id and
        the blocks its preemption gives the step): the others then give only what that
        leaves short, if they can, and nothing if it covers the step (squeezing them as
        well would only cost them context)."""
        if need <= 0 or not self.config.squeeze_below_budget:
            return {}
        if self.config.mode is ReclaimMode.NAIVE:
            return {}  # eviction frees no block there
        order, start = self._give_order(decoding, need, dict(excess or {}))
        if len(order) < need:
            if victim is None:
                return {}
            victim_id, victim_blocks = victim
            others = [r for r in decoding if r != victim_id]
            order, start = self._give_order(others, need, dict(excess or {}))
            if len(order) + victim_blocks >= need:
                order = order[: max(0, need - victim_blocks)]
            # else vLLM preempts more than the victim: each block given spares some of that
        taken: dict[str, int] = {}
        for request_id in order:
            taken[request_id] = taken.get(request_id, 0) + 1
        return {r: start[r] - count * self.block_size for r, count in taken.items()}

    def _give_order(
        self, decoding: list[str], need: int, excess: dict[str, int]
    ) -> tuple[list[str], dict[str, int]]:
        """Who gives each block, in order, up to ``need`` blocks (see :meth:`below_budget`),
        and each candidate's live tokens before giving (what its next step's blocks at
        budget hold with its next token)."""
        size = self.block_size
        heap: list[tuple[bool, float, str]] = []  # (tenant within allowance, -share, id)
        blocks, floors, kept, own = {}, {}, {}, {}  # next step's blocks at budget, ...
        for request_id in decoding:
            record = self.requests[request_id]
            policy = record.kv.policy
            if not self._evicts_to_budget(record):
                continue
            assert policy is not None
            budget = self._budget(record)
            kept[request_id] = max(record.shared_elsewhere * size, self._pinned_hit(record))
            own[request_id] = max(1, budget - kept[request_id])
            floor = kept[request_id] + math.ceil(self.config.squeeze_floor * own[request_id])
            floors[request_id] = max(floor, policy.num_protected(own[request_id]), 1)
            blocks[request_id] = cdiv(self._tokens_at(request_id, budget) + 1, size)
        start = {r: b * size - 1 for r, b in blocks.items()}
        held = {r: cdiv(self._tokens_at(r, self._budget(self.requests[r])), size) for r in blocks}

        def push(request_id: str) -> None:
            goal = (blocks[request_id] - 1) * size - 1  # live tokens after one more block
            if goal < floors[request_id] or self._tokens_at(request_id, goal) > goal:
                return  # at its floor, or its policy would keep more than the block holds
            share = (goal - kept[request_id]) / own[request_id]
            within = excess.get(self.requests[request_id].kv.tenant, 0) <= 0
            heapq.heappush(heap, (within, -share, request_id))

        for request_id in blocks:
            push(request_id)
        order: list[str] = []
        while heap and len(order) < need:
            within, _, request_id = heapq.heappop(heap)
            tenant = self.requests[request_id].kv.tenant
            if within != (excess.get(tenant, 0) <= 0):  # its tenant came within since
                heapq.heappush(heap, (not within, _, request_id))
                continue
            order.append(request_id)
            blocks[request_id] -= 1
            if tenant in excess:  # in blocks held: the first one given may be a next step's
                now = cdiv(blocks[request_id] * size - 1, size)
                excess[tenant] -= held[request_id] - now
                held[request_id] = now
            push(request_id)
        return order, start

    def _likely_victim(
        self, requests: dict[str, Any], ending: set[str], evicting: set[str] | None = None
    ) -> tuple[str, int] | None:
        """The request vLLM would preempt if the next step does not fit (its scheduler takes
        the last running one under first-come-first-served scheduling, the one assumed
        here) and the blocks that gives the step: what only it holds and what its own next
        step would have opened, less what its eviction this step (``evicting``) already
        gives."""
        for request_id in reversed(self.requests):
            if request_id in ending or request_id not in requests:
                continue
            if not self.requests[request_id].kv.table.block_ids:
                continue  # an allocation that failed: still waiting, not running
            blocks = self._blocks_returning(request_id) + self._next_step_blocks(
                request_id, requests
            )
            evicts = evicting is not None and request_id in evicting
            return request_id, blocks - (self._room(request_id) if evicts else 0)
        return None

    def _blocks_returning(self, request_id: str) -> int:
        """Blocks back in the pool when the request ends: those nobody else holds."""
        return sum(1 for block in self.stm.req_to_blocks[request_id] if block.ref_cnt == 1)

    def _held_per_tenant(self) -> dict[str, int]:
        """Blocks each tenant's requests hold here, shared blocks counted once."""
        held: dict[str, int] = {}
        for record in self.requests.values():  # ``shared_elsewhere``: _refresh_shared
            tenant = record.kv.tenant
            held[tenant] = held.get(tenant, 0) + record.kv.num_held_blocks - record.shared_elsewhere
        return held

    def _excess_over_allowance(self, always: set[str], ending: set[str]) -> dict[str, int]:
        """Blocks each tenant with an allowance here holds above it once this step's
        requests that always evict (to budget) and those ending with it gave theirs back."""
        if not self.allowance:
            return {}
        held = self._held_per_tenant()
        for request_id in always | ending:
            tenant = self.requests[request_id].kv.tenant
            if request_id in ending:
                held[tenant] = held.get(tenant, 0) - self._blocks_returning(request_id)
            else:
                held[tenant] = held.get(tenant, 0) - self.blocks_above_budget(request_id)
        return {t: held.get(t, 0) - limit for t, limit in self.allowance.items()}

    def _room(self, request_id: str, budget: int | None = None) -> int:
        """Blocks the next step needs fewer of if the decoding request evicts to ``budget``
        live tokens (default: its budget) now and repacks: it holds them with its next
        token in fewer blocks. 0 for a policy that would not evict if asked now, and in
        naive mode (eviction frees no block there)."""
        record = self.requests[request_id]
        if not self._evicts_to_budget(record) or self.config.mode is ReclaimMode.NAIVE:
            return 0
        table = record.kv.table
        budget = self._budget(record) if budget is None else budget
        now = len(table.block_ids) + table.num_blocks_needed(1)
        after = cdiv(self._tokens_at(request_id, budget) + 1, self.block_size)
        return max(0, now - after)

    def _tokens_at(self, request_id: str, budget: int) -> int:
        """Live tokens the request keeps after eviction to ``budget`` (what its policy
        protects at that budget, if more)."""
        record = self.requests[request_id]
        policy, table = record.kv.policy, record.kv.table
        assert policy is not None
        return min(table.num_live, max(budget, policy.num_protected(budget)))

    def _blocks_at(self, request_id: str, budget: int) -> int:
        """Blocks the request keeps after eviction to ``budget`` live tokens and a repack."""
        held = len(self.requests[request_id].kv.table.block_ids)
        return min(held, cdiv(self._tokens_at(request_id, budget), self.block_size))

    def _over_allowance(self, decoding: list[str], excess: Mapping[str, int]) -> set[str]:
        """Decoding requests to evict to budget so that each tenant fits its allowance
        (``excess``: :meth:`_excess_over_allowance`)."""
        chosen: set[str] = set()
        for tenant, over in excess.items():
            excess_left = over
            if excess_left <= 0:
                continue
            mine = [r for r in decoding if self.requests[r].kv.tenant == tenant]
            for request_id in self.squeeze_order(mine):
                if excess_left <= 0:
                    break
                chosen.add(request_id)
                excess_left -= self.blocks_above_budget(request_id)
        return chosen

    def blocks_needed_next_step(self, requests: dict[str, Any]) -> int:
        """Blocks the running requests may open next step: a prompt still in prefill its next
        chunk (at most the step's token budget), a decoding request one block at a block
        boundary."""
        return sum(self._next_step_blocks(request_id, requests) for request_id in self.requests)

    def _next_step_blocks(self, request_id: str, requests: dict[str, Any]) -> int:
        """Blocks one running request may open next step (0 if it ends with this one)."""
        request = requests.get(request_id)
        if request is not None and _ends_with_this_step(request):
            return 0  # its blocks come back instead
        table = self.requests[request_id].kv.table
        remaining = 0 if request is None else request.num_tokens - request.num_computed_tokens
        if self.max_step_tokens is not None:
            remaining = min(remaining, self.max_step_tokens)  # one chunk per step
        return table.num_blocks_needed(max(remaining, 1))

    def blocks_above_budget(self, request_id: str) -> int:
        """Blocks eviction to its budget (then a repack) would give back now: it keeps its
        budget or what its policy protects at that budget, if more. 0 for a policy that
        would not evict if asked now, and in naive mode (eviction frees no block there)."""
        record = self.requests[request_id]
        if not self._evicts_to_budget(record) or self.config.mode is ReclaimMode.NAIVE:
            return 0
        held = len(record.kv.table.block_ids)
        return max(0, held - self._blocks_at(request_id, self._budget(record)))

    def squeeze_order(self, request_ids: list[str]) -> list[str]:
        """Requests with blocks above their budget, most first (ties keep the given order)."""
        above = {request_id: self.blocks_above_budget(request_id) for request_id in request_ids}
        return sorted((r for r in request_ids if above[r] > 0), key=lambda r: -above[r])

    def _reclaim(self, record: ScheduledRequest) -> None:
        """Repack now; the workers copy the moves and cut vLLM's block row next step."""
        request_id = record.kv.request_id
        (plan,) = self.manager.reclaim([request_id])  # commits the table, frees blocks
        if not plan.touches_blocks:
            return  # at most dead tail tokens: the physical count dropped, nothing to ship
        if plan.num_moves:
            record.pending_src = np.concatenate([record.pending_src, plan.src_slots])
            record.pending_dst = np.concatenate([record.pending_dst, plan.dst_slots])
        num_kept = len(record.kv.table.block_ids)
        del self.stm.req_to_blocks[request_id][num_kept:]
        record.pending_num_blocks = num_kept

    def take_ops(self, num_scheduled_tokens: dict[str, int], requests: dict[str, Any]) -> StepOps:
        """The ops the workers apply before this step's forward (see ``StepOps``)."""
        num_evicted, score_needs = {}, {}
        for request_id in num_scheduled_tokens:
            record = self.requests.get(request_id)
            if record is None:
                continue
            table, policy = record.kv.table, record.kv.policy
            assert table.num_logical == requests[request_id].num_computed_tokens
            num_evicted[request_id] = table.num_logical - table.num_slots
            needs = policy.score_needs() if policy is not None else ScoreNeeds()
            if needs.any:
                score_needs[request_id] = needs
        src, dst, num_blocks = [_EMPTY], [_EMPTY], {}
        for request_id, record in self.requests.items():
            if record.pending_num_blocks is not None:
                src.append(record.pending_src)
                dst.append(record.pending_dst)
                num_blocks[request_id] = record.pending_num_blocks
                record.pending_src = record.pending_dst = _EMPTY
                record.pending_num_blocks = None
        return StepOps(
            src_slots=np.concatenate(src),
            dst_slots=np.concatenate(dst),
            num_blocks=num_blocks,
            num_evicted=num_evicted,
            score_needs=score_needs,
        )

    # ------------------------------------------------------------------ lifecycle
    def free(self, request_id: str, preempted: bool = False) -> None:
        """Finish, abort or preemption: every block goes back, the table is dropped.

        A preempted request starts over with a fresh table (and policy) when it resumes:
        vLLM recomputes its whole sequence.
        """
        report = self.manager.report(request_id)
        record = self.requests.pop(request_id)
        if preempted:
            self.num_preemptions += 1
        else:
            finished = report.model_copy(update={"finished": True})
            self.finished[request_id] = FinishedRequest(finished, record.evictions)
            while len(self.finished) > MAX_FINISHED_RECORDS:
                self.finished.popitem(last=False)
        self.manager.free_request(request_id)
        self.stm.pop_blocks_for_free(request_id)  # vLLM's bookkeeping; blocks already freed

    # ------------------------------------------------------------------ reports
    def request_report(self, request_id: str) -> RequestReport | None:
        """One request's report: running, or among the recently finished.

        ``request_id`` may be the client's id: vLLM's front end appends ``-<8 chars>`` to
        it for the engine core, so the most recent request with that prefix is returned.
        """

        def matches(engine_id: str) -> bool:
            return engine_id == request_id or engine_id.rpartition("-")[0] == request_id

        for engine_id in reversed(self.requests):
            if matches(engine_id):
                return self.manager.report(engine_id)
        for engine_id in reversed(self.finished):
            if matches(engine_id):
                return self.finished[engine_id].report
        return None

    def snapshot(self) -> EngineReport:
        """What this engine holds now (crosses processes as a utility result, dumped)."""
        return EngineReport(
            mode=self.config.mode,
            policy=self.config.policy,
            block_size=self.block_size,
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free_blocks,
            num_preemptions=self.num_preemptions,
            blocks_reclaimed=self.manager.num_blocks_reclaimed,
            num_evictions_under_pressure=self.num_evictions_under_pressure,
            num_evictions_to_bound=self.num_evictions_to_bound,
            num_evictions_below_budget=self.num_evictions_below_budget,
            recent_max_step_s=self.step_times.recent_max_s(),
            recent_steps=self.step_times.recent_longest(),
            evicted_tokens_total=self.manager.num_evicted_tokens,
            repack_moves_total=self.manager.num_repack_moves,
            repack_bytes_total=self.repack_bytes_total,
            repack_seconds_total=self.repack_seconds_total,
            requests=self.manager.reports(
                {  # a request in prefill has no budget yet: nothing of it can be evicted
                    request_id: self._budget(record)
                    for request_id, record in self.requests.items()
                    if record.kv.table.num_logical >= record.kv.prompt_len
                }
            ),
        )

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        assert self.requests.keys() == self.manager.requests.keys(), "records out of sync"
        for request_id, record in self.requests.items():
            kv = record.kv
            vllm_ids = [block.block_id for block in self.stm.req_to_blocks[request_id]]
            assert vllm_ids == kv.table.block_ids, f"{request_id}: vLLM blocks != token table"
            assert kv.table.num_slots == kv.table.num_live, f"{request_id}: not repacked"
            assert len(kv.table.block_ids) == kv.table.num_ideal_blocks
            naive = self.config.mode is ReclaimMode.NAIVE
            ballast = kv.table.num_naive_blocks() - len(kv.table.block_ids) if naive else 0
            assert len(kv.ballast) == ballast, f"{request_id}: ballast is not Naive-Evict's"
            assert 0 not in kv.table.block_ids + kv.ballast, "the null block was handed out"
            # Published and protected prefixes are live and in place: what their hashes say.
            num_published = self.stm.num_cached_block.get(request_id, 0) * self.block_size
            for name, length in (("published", num_published), ("protected", record.protected)):
                n = min(length, kv.table.num_logical)
                in_place = np.arange(n)
                assert (kv.table.live_slots()[:n] == in_place).all(), f"{name} token moved"
                assert (kv.table.live_logical_ids()[:n] == in_place).all(), f"{name} token lost"
            if record.cacheable is not None:
                assert num_published <= record.cacheable, f"{request_id}: published past"
            # Only published blocks (what their hashes say) are shared.
            reach = num_published // self.block_size
            shared = [i for i, b in enumerate(kv.table.block_ids) if self.pool.ref_count(b) > 1]
            assert all(i < reach for i in shared), f"{request_id}: shares unpublished blocks"
        # vLLM's reference counts are the holders: several only for shared (pinned) blocks.
        holders: dict[int, int] = {}
        for record in self.requests.values():
            for block_id in record.kv.table.block_ids + record.kv.ballast:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id, count in holders.items():
            assert self.pool.ref_count(block_id) == count, f"block {block_id}: ref count"
        charged = sum(report.allocated_blocks for report in self.manager.reports())
        assert charged == len(holders), "a shared block is charged other than once"
