"""What each running request may keep this step, and the squeeze planner's view of it.

Reads the scheduler side's records, vLLM's block lists and the tenants' pressure; changes
nothing. ``workers/scheduler_side.py`` asks it for a :class:`SqueezePlanner` per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from vtoken.block_eviction import num_protected_block_tokens
from vtoken.repack_planner import ReclaimMode
from workers.config import VTokenConfig
from workers.prefix_cache import PrefixCacheRule
from workers.scheduled_request import ScheduledRequest, ends_with_this_step
from workers.squeeze import RequestView, SqueezePlanner
from workers.tenant_pressure import TenantPressure


class RequestBudgets:
    """Budgets and squeeze views of one engine core's running requests (``stm``: vLLM's
    ``FullAttentionManager``; ``max_step_tokens``: vLLM's token budget of one step)."""

    def __init__(
        self,
        config: VTokenConfig,
        block_size: int,
        prefix: PrefixCacheRule,
        tenants: TenantPressure,
        stm: Any,
        max_step_tokens: int | None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.prefix = prefix
        self.tenants = tenants
        self.stm = stm
        self.max_step_tokens = max_step_tokens

    def pinned_hit(self, record: ScheduledRequest) -> int:
        """Tokens of its cache hit the request keeps for life (``pin_cache_hits``)."""
        return self.prefix.pinned_hit(record, self.tenants.applies_to(record.kv.tenant))

    def unpaid(self, record: ScheduledRequest) -> int:
        """Leading tokens in blocks another request pays for that the request keeps this
        step whatever its budget: none, as it copies what it evicts from (copy on evict),
        unless it found no free block for the copies (``copy_deferred``)."""
        return record.shared_elsewhere * self.block_size if record.copy_deferred else 0

    def unbudgeted(self, record: ScheduledRequest) -> int:
        """Leading tokens kept outside its policy's budget: :meth:`unpaid` and, with
        ``pin_cache_hits``, its cache hit (both are prefixes of its table)."""
        return max(self.unpaid(record), self.pinned_hit(record))

    def budget(self, record: ScheduledRequest) -> int:
        """Live tokens the request may keep after this step.

        Its policy's budget applies to every token it keeps, shared with another request or
        not, as with caching off, except what it pinned: with ``pin_cache_hits`` its cache
        hit, and shared blocks it could not copy this step (:meth:`unpaid`), are kept on
        top of it. Then the hard bounds, on what it pays for: its ``hold_blocks`` (what
        admission counts it at, a block for the step) and its tenant's pressure
        (``fraction x anchor``). The policy still keeps what it protects
        (:meth:`SqueezePlanner.blocks_above_budget` counts it)."""
        unpaid = self.unpaid(record)
        kept = self.unbudgeted(record)
        budget = record.spec.budget(max(0, record.kv.table.num_logical - kept)) + kept
        if record.hold_blocks is not None:
            budget = min(budget, max(1, (record.hold_blocks - 1) * self.block_size) + unpaid)
        bound = self.tenants.bound(record.kv.tenant, record.pressure_anchor)
        if bound is not None:
            budget = min(budget, bound + unpaid)
        return budget

    def planner(
        self,
        records: Mapping[str, ScheduledRequest],
        requests: Mapping[str, Any],
        num_free_blocks: int,
        fairness: tuple[Mapping[str, float], int] = ({}, 0),
        victim_order: Sequence[str] = (),
    ) -> SqueezePlanner:
        """The squeeze arithmetic over ``records`` (every running request, in the order
        vLLM added them) as they stand now (``requests``: vLLM's, for what each one's next
        step needs). ``fairness``: the present tenants' weights and the pool's blocks
        (none: fairness off); ``victim_order``: see :class:`SqueezePlanner`."""
        return SqueezePlanner(
            {request_id: self.view(record, requests) for request_id, record in records.items()},
            num_free_blocks=num_free_blocks,
            block_size=self.block_size,
            allowance=self.tenants.allowance,
            eager=self.config.eviction == "eager",
            frees_blocks=self.config.mode is not ReclaimMode.NAIVE,
            squeeze_below_budget=self.config.squeeze_below_budget,
            squeeze_floor=self.config.squeeze_floor,
            tenant_weights=fairness[0],
            pool_blocks=fairness[1],
            victim_order=victim_order,
        )

    def view(self, record: ScheduledRequest, requests: Mapping[str, Any]) -> RequestView:
        """What the squeeze planner reads of one running request now."""
        kv, request = record.kv, requests.get(record.kv.request_id)
        policy, table = kv.policy, kv.table
        assert policy is not None
        return RequestView(
            tenant=kv.tenant,
            num_blocks=len(table.block_ids),
            num_paid_blocks=record.paid_blocks,
            num_live=table.num_live,
            num_next_token_blocks=table.num_blocks_needed(1),
            num_next_step_blocks=self.next_step_blocks(record, request),
            budget=self.budget(record),
            num_unbudgeted=self.unbudgeted(record),
            protected_at=self.protected_at(record),
            sole_blocks=partial(self.sole_blocks, kv.request_id),
            evicts_to_budget=policy.holds_budget_every_step and policy.needs_budget,
            own_timing=not policy.holds_budget_every_step,
            capped=record.capped,
            under_pressure=self.tenants.applies_to(kv.tenant),
            hold_blocks=record.hold_blocks,
            running=request is not None,
            ending=request is not None and ends_with_this_step(request),
            num_shared_blocks=self.copied_on_evict(record),
        )

    def copied_on_evict(self, record: ScheduledRequest) -> int:
        """Blocks another request also holds that the request copies if it evicts from
        them (past its pinned prefix; none while it cannot copy, or in block mode)."""
        if record.copy_deferred or self.config.mode is ReclaimMode.BLOCK:
            return 0
        pinned = max(self.config.prefix_pin_tokens, self.pinned_hit(record))
        return len(self.prefix.shared_indices(record, pinned // self.block_size))

    def protected_at(self, record: ScheduledRequest) -> Callable[[int], int]:
        """Tokens the request's policy keeps past a budget; in block mode the whole blocks
        its protected tokens pin (:func:`~vtoken.block_eviction.num_protected_blocks`)."""
        policy, pinned = record.kv.policy, record.kv.num_pinned
        assert policy is not None
        if self.config.mode is ReclaimMode.BLOCK:
            return partial(
                num_protected_block_tokens, policy, num_pinned=pinned, block_size=self.block_size
            )
        return partial(policy.num_protected, num_pinned=pinned)

    def next_step_blocks(self, record: ScheduledRequest, request: Any | None) -> int:
        """Blocks one running request may open next step (0 if it ends with this one): a
        prompt still in prefill its next chunk (at most the step's token budget), a
        decoding request one block at a block boundary."""
        if request is not None and ends_with_this_step(request):
            return 0  # its blocks come back instead
        remaining = 0 if request is None else request.num_tokens - request.num_computed_tokens
        if self.max_step_tokens is not None:
            remaining = min(remaining, self.max_step_tokens)  # one chunk per step
        return record.kv.table.num_blocks_needed(max(remaining, 1))

    def sole_blocks(self, request_id: str) -> int:
        """Blocks back in the pool when the request ends: those nobody else holds (read
        only when asked: it reads every block's reference count)."""
        return sum(1 for block in self.stm.req_to_blocks[request_id] if block.ref_cnt == 1)
