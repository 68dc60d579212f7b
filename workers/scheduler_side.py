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
With tensor parallelism only the driver rank's output comes back: the ranks combine their
statistics first (``workers/tensor_parallel.py``), so they cover every head.

Who evicts, and how far, is the squeeze planner's arithmetic (``workers/squeeze.py``);
what a request may publish to vLLM's prefix cache and which prefix it pins is the
prefix-cache rule (``workers/prefix_cache.py``); the controller's pressure and allowances
are ``workers/tenant_pressure.py``.

``naive`` mode (Naive-Evict): the same decisions and the same physical compaction (so
attention is identical); the manager also holds *ballast* blocks from the pool, so a
request holds what a block-granular manager would (``vtoken/manager.py``). ``block``
mode (block-granular eviction): the policy drops whole blocks, which leave the middle of
vLLM's block list; the workers rewrite the request's row (``StepOps.block_rows``), no KV
moves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels.intmath import cdiv
from vtoken.groups import ModelGeometry
from vtoken.manager import VTokenManager
from vtoken.policy import StepAttention
from vtoken.repack_planner import ReclaimMode
from vtoken.reports import DEFAULT_TENANT, EngineReport, RequestReport
from workers.config import VTokenConfig, request_policy_spec
from workers.engine_reports import engine_snapshot, request_report
from workers.fair_share import FairShare
from workers.messages import StepOps, StepScores
from workers.prefix_cache import PrefixCacheRule
from workers.request_budgets import RequestBudgets
from workers.scheduled_request import (
    FinishedRequest,
    ScheduledRequest,
    hold_blocks_of,
    take_ops,
)
from workers.score_timing import ScoreTiming
from workers.squeeze import SqueezePlan, SqueezePlanner
from workers.step_counters import StepCounters
from workers.step_times import StepTimes
from workers.tenant_pressure import TenantPressure
from workers.vllm_block_pool import VLLMBlockPool

if TYPE_CHECKING:
    from workers.vllm_patches.sliding_groups import SlidingGroups

MAX_FINISHED_RECORDS = 4096
logger = logging.getLogger(__name__)


class VTokenScheduler:
    """Token tables, policies and block accounting of one engine core.

    ``single_type_manager`` is vLLM's ``FullAttentionManager`` (its ``req_to_blocks`` is
    kept equal to the tables' block ids); ``sliding``: a hybrid model's sliding-window
    groups, which vLLM keeps beside it (counted in admission and reports, never evicted
    from). Invariants in ``check_invariants``.
    """

    def __init__(
        self,
        config: VTokenConfig,
        block_pool: Any,
        single_type_manager: Any,
        max_step_tokens: int | None = None,
        geometry: ModelGeometry | None = None,
        sliding: SlidingGroups | None = None,
    ) -> None:
        """``geometry``: where the engine can keep a set per layer or (layer, KV head)."""
        self.config = config
        self.max_step_tokens = max_step_tokens  # vLLM's token budget of one step
        self.sliding = sliding
        self.pool = VLLMBlockPool(block_pool, sliding.held_blocks if sliding else None)
        self.block_size = int(single_type_manager.block_size)
        self.stm = single_type_manager
        self.manager = VTokenManager(self.pool, self.block_size, config.mode, geometry)
        self.prefix = PrefixCacheRule(config, self.manager, self.pool, single_type_manager)
        self.tenants = TenantPressure()
        self.budgets = RequestBudgets(
            config, self.block_size, self.prefix, self.tenants, self.stm, max_step_tokens
        )
        self.score_timing = ScoreTiming(config, self.block_size, self.tenants, max_step_tokens)
        self.requests: dict[str, ScheduledRequest] = {}
        self.finished: OrderedDict[str, FinishedRequest] = OrderedDict()
        self.counters = StepCounters()
        self.step_times = StepTimes()
        # Weighted fairness (``workers/fair_share.py``): queue and preemption order hooked
        # in by ``workers/vllm_patches/scheduler_hooks.py``; ``None`` when off.
        self.fair = FairShare.of(config)
        # Why this engine keeps one set per request (set by the scheduler hook), and the
        # requests refused here, which vLLM finishes with an error at the next update.
        self.grouping_problems: list[str] = []
        self.refused: set[str] = set()

    # The counters ``bench/`` reads (``fragmentation``, ``concurrency``, ``preemption``).
    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    @property
    def num_evictions_under_pressure(self) -> int:
        return self.counters.num_evictions_under_pressure

    @property
    def num_evictions_below_budget(self) -> int:
        return self.counters.num_evictions_below_budget

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
        if request_id in self.refused:
            return None
        if request_id not in self.requests:
            try:
                self._add(request)
            except ValueError as error:  # never raise in vLLM's schedule for one request
                logger.error("vToken: request %s refused: %s", request_id, error)
                self.refused.add(request_id)
                return None
        record = self.requests[request_id]
        table = record.kv.table
        assert table.num_logical == request.num_computed_tokens, (
            f"{request_id}: table has {table.num_logical} tokens, vLLM computed "
            f"{request.num_computed_tokens}"
        )
        if hit_blocks:
            resumed = bool(getattr(request, "num_preemptions", 0))
            if not self.prefix.adopt(record, hit_blocks, num_new_tokens, reserve, resumed):
                return None
        block_ids = self.manager.allocate(request_id, num_new_tokens, reserve)
        if block_ids is None:
            assert not hit_blocks, "room was checked with the hit"
            return None
        blocks = self.pool.blocks(block_ids)
        self.stm.req_to_blocks[request_id].extend(blocks)
        if self.stm.records_new_block_ids:
            self.stm.new_block_ids.extend(block_ids)
        return blocks

    def hit_limit(self, request: Any) -> int | None:
        """See :meth:`PrefixCacheRule.hit_limit` (``request``: vLLM's, not started)."""
        params = request.sampling_params
        extra = (params.extra_args if params is not None else None) or {}
        spec = request_policy_spec(extra) or self.config
        return self.prefix.hit_limit(spec, request.num_prompt_tokens)

    def num_cacheable_tokens(self, request_id: str, num_tokens: int) -> int:
        """See :meth:`PrefixCacheRule.num_cacheable_tokens`."""
        return self.prefix.num_cacheable_tokens(self.requests[request_id], num_tokens)

    def blocks_needed_for(self, num_tokens: int) -> int:
        """Blocks a fresh request needs for ``num_tokens`` tokens (admission check), every
        group's: a sliding-window group's bound is its window."""
        window = 0 if self.sliding is None else self.sliding.admission_blocks(num_tokens)
        return cdiv(num_tokens, self.block_size) + window

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
            kv, spec, capped=spec is not self.config, hold_blocks=hold_blocks_of(extra)
        )
        self.prefix.protect(record, self.config.prefix_pin_tokens)
        self.requests[request.request_id] = record
        self.stm.req_to_blocks[request.request_id]  # defaultdict: create the empty list

    # ------------------------------------------------------------------ steps
    def after_step(
        self,
        num_scheduled_tokens: dict[str, int],
        requests: dict[str, Any],
        scores: StepScores | None,
        num_waiting_blocks: int = 0,
        victim_order: Sequence[str] = (),
    ) -> None:
        """Run the policies of the requests that ran this step, commit repacks, free blocks.

        A prefill chunk that does not complete its prompt counts as a decoding step here
        when its policy evicts during prefill (:meth:`_prefill_chunks`): its budget is the
        one at the tokens computed so far (never above ``hold_to_blocks``), so a long
        prompt holds about one chunk plus its budget; otherwise its policy only observes.

        ``eager``: every such request evicts to its budget. ``on_demand``: a
        request only feeds its policy this step's attention, unless memory is needed:
        ``num_waiting_blocks`` (what the head of vLLM's waiting queue needs to start), the
        blocks running prefills still need, and a block for every decoding request whose
        next token opens one, beyond the free blocks; then the squeeze planner
        (:meth:`SqueezePlanner.plan`) picks who evicts to budget, and below it. Always
        evicting, in both modes: requests under controller pressure (``set_pressure``),
        requests under a tenant's per-request cap (admission counted on it), and policies
        that decide at one step only.
        """
        attention_of = scores.attention if scores is not None else {}
        if scores is not None:
            self.counters.take_repack_totals(scores.repack_bytes_total, scores.repack_seconds_total)
        running = [r for r in num_scheduled_tokens if r in self.requests and r in requests]
        decoding = [r for r in running if requests[r].num_computed_tokens >= requests[r].num_tokens]
        chunked = self._prefill_chunks([r for r in running if r not in decoding], attention_of)
        for request_id in decoding:
            record = self.requests[request_id]
            if self.tenants.applies_to(record.kv.tenant) and record.pressure_anchor is None:
                record.pressure_anchor = record.kv.table.num_live  # new under pressure
        self._refresh_shared()
        evicting = [*decoding, *chunked]
        records = [self.requests[request_id] for request_id in evicting]
        self.prefix.reserve_copies(records, self.budgets.pinned_hit)
        for record in records:  # what room estimates read (sinks) is this step's
            self._protect_shared(record)
        # Eager: every decoding request and such chunk evicts to budget, nothing else is read.
        viewed = evicting if self.config.eviction == "eager" else None
        planner = self.squeeze_planner(requests, viewed, victim_order)
        plan = planner.plan(decoding, num_waiting_blocks, prefilling=chunked)
        for record in records:
            attention = attention_of.get(record.kv.request_id, StepAttention())
            self._evict(record, plan, attention)
        # Copy on evict: every copy's block allocated before any repack frees one.
        self.prefix.copy_shared(records)
        for record in records:
            self.counters.num_shared_copies += len(record.copied)
            self._reclaim(record)
        if self.config.check_invariants:
            self.check_invariants()

    def _prefill_chunks(
        self, prefilling: list[str], attention_of: Mapping[str, StepAttention]
    ) -> list[str]:
        """This step's prefill chunks that did not complete their prompt: those whose
        policy evicts during prefill are returned (each evicts like a decoding request,
        :meth:`_evict`: to its budget at the tokens computed so far when the plan says so,
        and a step counted either way); the others' policies only observe the chunk's
        attention (SnapKV and PAGE decide when the prompt is complete)."""
        chunked = []
        for request_id in prefilling:
            policy = self.requests[request_id].kv.policy
            if policy is not None and policy.evicts_during_prefill:
                chunked.append(request_id)
            else:
                self.manager.observe(request_id, attention_of.get(request_id, StepAttention()))
        return chunked

    def _evict(self, record: ScheduledRequest, plan: SqueezePlan, attention: StepAttention) -> None:
        """One request's step (decoding, or a prefill chunk under a policy that evicts
        during prefill): its policy runs (to its budget if the plan squeezes it, else with
        a budget of everything it holds: it observes and counts the step), then it
        unpublishes what changed; it repacks once the step's copies have their blocks."""
        request_id = record.kv.request_id
        budget = plan.budgets.get(request_id, record.kv.table.num_live)
        if not record.scored and budget < record.kv.table.num_live:
            # Its step was not scored (memory looked free when it was scheduled): it keeps
            # its tokens this step rather than evict blind; counted, never expected.
            self.counters.num_evictions_unscored += 1
            budget = record.kv.table.num_live
        self._protect_shared(record)  # a policy may evict on its own (a fixed window)
        evicted = self.manager.evict(request_id, budget, attention)
        if evicted.size:  # a grouped answer is [groups, k]: len() counts groups
            self.prefix.unpublish_changed(record)
            self.counters.count_eviction(plan.causes.get(request_id))
            self.counters.num_copies_deferred += self.prefix.copies_deferred(record)
        if self.config.record_evictions:
            record.evictions.append(evicted)

    def set_pressure(
        self, pressure: Mapping[str, float], allowance: Mapping[str, int] | None = None
    ) -> None:
        """The controller's eviction pressure (tenant -> keep fraction in (0, 1]) and
        allowances (tenant -> blocks), as ``workers/tenant_pressure.py`` states them; both
        eviction modes. In ``on_demand`` mode a tenant above its allowance has its decoding
        requests evicted to their budgets, most blocks above budget first, until it fits,
        at every step (without waiting for the controller's next plan). Bad values raise
        ``ValueError``."""
        changed = self.tenants.update(pressure, allowance)
        for record in self.requests.values():
            kv = record.kv
            decoding = kv.table.num_logical >= kv.prompt_len
            record.pressure_anchor = self.tenants.anchor(
                kv.tenant, record.pressure_anchor, kv.table.num_live, decoding, changed
            )

    def _refresh_shared(self) -> None:
        """Which blocks each request holds that another pays for (prefix caching only)."""
        elsewhere = self.manager.charged_elsewhere()
        for request_id, record in self.requests.items():
            record.shared_elsewhere = elsewhere.get(request_id, 0)

    def _protect_shared(self, record: ScheduledRequest) -> None:
        self.prefix.protect_shared(record, self.budgets.pinned_hit(record))

    def squeeze_planner(
        self,
        requests: Mapping[str, Any] | None = None,
        viewed: Iterable[str] | None = None,
        victim_order: Sequence[str] = (),
    ) -> SqueezePlanner:
        """The squeeze arithmetic over the running requests (``viewed``, default all) as
        they stand now (``requests``: vLLM's, for what each one's next step needs;
        ``victim_order``: see :class:`SqueezePlanner`)."""
        records = self.requests if viewed is None else {r: self.requests[r] for r in viewed}
        tenants = (record.kv.tenant for record in self.requests.values())
        weights = {} if self.fair is None else self.fair.present_weights(tenants)
        fairness = (weights, self.pool.num_blocks)
        return self.budgets.planner(
            records, requests or {}, self.pool.num_free_blocks, fairness, victim_order
        )

    def blocks_above_budget(self, request_id: str) -> int:
        """See :meth:`SqueezePlanner.blocks_above_budget`."""
        return self.squeeze_planner().blocks_above_budget(request_id)

    # ------------------------------------------------------------------ ops outbox
    def _reclaim(self, record: ScheduledRequest) -> None:
        """Repack now; the workers copy the moves and cut vLLM's block row next step (in
        block mode, nothing to copy: they rewrite the row without the dropped blocks)."""
        request_id = record.kv.request_id
        (plan,) = self.manager.reclaim([request_id])  # commits the table, frees blocks
        if not plan.touches_blocks and not record.copied:
            return  # at most dead tail tokens: the physical count dropped, nothing to ship
        src, dst, groups = self.prefix.copy_moves(record, plan)  # copied blocks from shared
        record.queue_moves(src, dst, groups, self.manager.geometry)
        dropped = set(plan.free_block_indices.tolist())
        blocks = self.stm.req_to_blocks[request_id]
        blocks[:] = [block for index, block in enumerate(blocks) if index not in dropped]
        if record.copied:  # blocks replaced in the middle: the workers rewrite the row
            record.pending_block_row = np.asarray(record.kv.table.block_ids, dtype=np.int32)
        if self.config.mode is ReclaimMode.BLOCK:
            record.pending_block_row = np.asarray(record.kv.table.block_ids, dtype=np.int32)
        else:
            record.pending_num_blocks = len(blocks)

    def take_ops(
        self,
        num_scheduled_tokens: dict[str, int],
        requests: dict[str, Any],
        num_waiting_blocks: int = 0,
    ) -> StepOps:
        """The ops the workers apply before this step's forward (see ``StepOps``), with the
        statistics of the requests that may evict after it (``workers/score_timing.py``;
        ``num_waiting_blocks`` as in :meth:`after_step`)."""
        self._refresh_shared()  # a request that paid for shared blocks may have finished
        scored = self.score_timing.may_evict(
            self.requests,
            requests,
            num_scheduled_tokens,
            self.pool.num_free_blocks,
            num_waiting_blocks,
        )
        ops = take_ops(self.requests, num_scheduled_tokens, requests, scored)
        self.counters.num_scored_request_steps += len(ops.score_needs)
        return ops

    # ------------------------------------------------------------------ lifecycle
    def free(self, request_id: str, preempted: bool = False) -> None:
        """Finish, abort or preemption: every block goes back, the table is dropped.

        A preempted request starts over with a fresh table (and policy) when it resumes:
        vLLM recomputes its whole sequence.
        """
        report = self.manager.report(request_id)
        record = self.requests.pop(request_id)
        if preempted:
            self.counters.num_preemptions += 1
        else:
            finished = report.model_copy(update={"finished": True})
            self.finished[request_id] = FinishedRequest(finished, record.evictions)
            while len(self.finished) > MAX_FINISHED_RECORDS:
                self.finished.popitem(last=False)
        self.manager.free_request(request_id)
        self.stm.pop_blocks_for_free(request_id)  # vLLM's bookkeeping; blocks already freed

    # ------------------------------------------------------------------ reports
    def request_report(self, request_id: str) -> RequestReport | None:
        """One request's report, running or recently finished (:func:`find_report`)."""
        return request_report(self, request_id)

    def snapshot(self) -> EngineReport:
        """What this engine holds now (crosses processes as a utility result, dumped)."""
        return engine_snapshot(self)

    def check_invariants(self) -> None:
        self.manager.check_invariants()
        assert self.requests.keys() == self.manager.requests.keys(), "records out of sync"
        naive = self.config.mode is ReclaimMode.NAIVE
        for request_id, record in self.requests.items():
            vllm_ids = [block.block_id for block in self.stm.req_to_blocks[request_id]]
            record.check_invariants(vllm_ids, naive)
            self.prefix.check_invariants(record)
        self.prefix.check_holders(self.requests.values())
