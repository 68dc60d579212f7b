"""The prefix-cache rule: what a request may publish, pin and must unpublish.

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
  config: a tenant's system prompt stays cacheable however hard the request is squeezed)
  and, with ``pin_cache_hits``, its cache hit (kept and cached for the request's life,
  outside its policy's budget; not for a resumed request, whose hit is its own sequence,
  nor under a hard bound). Its policy protects them as sinks (``RequestKV.num_pinned``).
- caching never changes what a policy keeps (*copy on evict*): a block another request
  also holds (reference count > 1: a block it took from a cache hit while its first
  holder still runs, one of its own that a later request took, the shared prompt of
  ``n > 1`` choices) is evicted from like any other. The request that evicts repacks its
  survivors into blocks of its own, newly allocated (the copies ride with the repack's
  moves, :meth:`PrefixCacheRule.copy_moves`), and drops its reference: the shared block
  stays intact and cached for the other holders, and no hit ever reads a block that
  changed. Before the step's evictions, every evicting request reserves a free block per
  shared block it could touch (:meth:`PrefixCacheRule.reserve_copies`); one that finds
  none keeps its shared blocks that step, protected as sinks and outside its budget as
  before (counted: ``StepCounters.num_copies_deferred``). A shared block the repack
  empties is only released, not copied. (vLLM itself drops a cached block's hash when it
  hands the block out again.)
- a shared block is charged once, to its earliest current holder
  (``VTokenManager.charged_elsewhere``); a copy is its request's own block, charged to it.
  A request's policy budget counts every token it keeps, shared or not, as with caching
  off; only a request that could not copy keeps the shared prefix on top of its budget
  and outside ``hold_blocks`` that step. With ``pin_cache_hits`` a request keeps its cache
  hit on top of its policy's budget, unless a hard bound applies to it (``hold_blocks``,
  a tenant's cap, pressure).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kernels.intmath import cdiv
from vtoken.manager import VTokenManager
from vtoken.repack_planner import ReclaimMode, RepackPlan
from workers.config import PolicySpec, VTokenConfig
from workers.scheduled_request import ScheduledRequest
from workers.vllm_block_pool import VLLMBlockPool


class PrefixCacheRule:
    """Applies the rule above to vLLM's ``FullAttentionManager`` (``stm``: its
    ``req_to_blocks`` and ``num_cached_block``, the published full blocks per request)."""

    def __init__(
        self, config: VTokenConfig, manager: VTokenManager, pool: VLLMBlockPool, stm: Any
    ) -> None:
        self.config = config
        self.manager = manager
        self.pool = pool
        self.stm = stm
        self.block_size = manager.block_size

    def adopt(
        self,
        record: ScheduledRequest,
        hit_blocks: Sequence[Any],
        num_new_tokens: int,
        reserve: int,
        resumed: bool,
    ) -> bool:
        """Start the request's empty table with ``hit_blocks`` (vLLM's cache hit: full
        blocks, published already; the request takes a reference on them) if the pool can
        also give the blocks of its ``num_new_tokens`` while keeping ``reserve`` free;
        ``False``, nothing taken, when it cannot. A resumed request's hit is its own
        sequence: never pinned (memory is short)."""
        request_id = record.kv.request_id
        if record.kv.table.num_logical:
            raise RuntimeError(f"vToken: a prefix-cache hit for running {request_id}")
        num_hit = len(hit_blocks) * self.block_size
        # A hit block nobody holds sits in vLLM's free queue: taking it uses a free block.
        taken = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        needed = cdiv(num_hit + num_new_tokens, self.block_size) - len(hit_blocks)
        if needed + taken + reserve > self.pool.num_free_blocks:
            return False
        self.pool.share(hit_blocks)
        self.manager.adopt(request_id, [block.block_id for block in hit_blocks])
        self.stm.req_to_blocks[request_id].extend(hit_blocks)
        self.stm.num_cached_block[request_id] = len(hit_blocks)  # published already
        record.hit_tokens = 0 if resumed else num_hit
        return True

    def hit_limit(self, spec: PolicySpec, num_prompt_tokens: int) -> int | None:
        """The longest prefix-cache hit (tokens) a new request under ``spec`` may take, so
        that its policy reads at the end of prefill the statistics it reads with caching
        off (a hit's queries are never computed). A policy that accumulates every query's
        attention (H2O, Scissorhands): its pinned prefix (``prefix_pin_tokens``; causal,
        those queries read only pinned keys, whose scores no decision reads). One that reads
        the last queries (SnapKV, PAGE): up to its window. ``None``, no limit, for one that
        reads only the last query or nothing (TOVA, StreamingLLM, Random, ``none``), with
        ``pin_cache_hits`` (a hit is pinned outside the policy then), and under
        ``on_demand`` eviction, which follows memory, which caching itself changes."""
        if self.config.eviction != "eager" or self.config.pin_cache_hits:
            return None
        policy = spec.make_policy()
        if not policy.evicts:
            return None
        if policy.observes_every_step:
            return self.config.prefix_pin_tokens
        window = policy.score_needs().query_window
        return max(0, num_prompt_tokens - window) if window > 1 else None

    def num_cacheable_tokens(self, record: ScheduledRequest, num_tokens: int) -> int:
        """How many of a request's first ``num_tokens`` tokens may be published to the
        prefix cache (vLLM publishes the full blocks among them): all of them until it
        first evicted, then what lay below its first eviction."""
        cacheable = record.cacheable
        return num_tokens if cacheable is None else min(num_tokens, cacheable)

    def protect(self, record: ScheduledRequest, num_tokens: int) -> None:
        """Its policy may not evict the request's first ``num_tokens`` tokens (they join its
        own sinks) until the next call."""
        policy = record.kv.policy
        if policy is None or not policy.evicts:
            return
        record.kv.num_pinned = num_tokens

    def protect_shared(self, record: ScheduledRequest, pinned_hit: int) -> None:
        """Before an eviction: protect the pinned prefix (``prefix_pin_tokens``, a pinned
        cache hit of ``pinned_hit`` tokens) and, when the request found no free block to
        copy them into (``copy_deferred``), every block another request also holds (only
        published blocks are shared: hits take them from the start)."""
        policy = record.kv.policy
        if policy is None or not policy.evicts:
            return
        pinned = max(self.config.prefix_pin_tokens, pinned_hit)
        if record.copy_deferred:
            shared = self.shared_indices(record)
            pinned = max(pinned, (shared[-1] + 1) * self.block_size if shared else 0)
        self.protect(record, pinned)

    def shared_indices(self, record: ScheduledRequest, start: int = 0) -> list[int]:
        """Indices into the request's block list, from ``start``, of the blocks another
        request also holds (published ones: hits take them from the start)."""
        blocks = self.stm.req_to_blocks[record.kv.request_id]
        return [i for i in range(start, len(blocks)) if blocks[i].ref_cnt > 1]

    def reserve_copies(self, records: Iterable[ScheduledRequest], pinned_hit: Any) -> None:
        """Before a step's evictions: each of ``records`` (those that may evict, in order)
        reserves a free block for every shared block past its pinned prefix
        (``pinned_hit(record)``: its pinned cache hit) that its eviction could touch; one
        that finds too few keeps its shared blocks this step (``copy_deferred``). Block
        mode drops whole blocks and never writes one: it copies nothing and keeps every
        block another request holds (dropping one would free nothing, and a later shared
        block would slide past what is published)."""
        free = self.pool.num_free_blocks
        for record in records:
            record.copy_deferred = self.config.mode is ReclaimMode.BLOCK
            if record.copy_deferred:
                continue
            pinned = max(self.config.prefix_pin_tokens, pinned_hit(record))
            wanted = len(self.shared_indices(record, pinned // self.block_size))
            if wanted > free:
                record.copy_deferred = True
            else:
                free -= wanted

    def copies_deferred(self, record: ScheduledRequest) -> bool:
        """Whether the request kept shared blocks for want of free ones (block mode keeps
        them by rule: not a deferral)."""
        return record.copy_deferred and self.config.mode is not ReclaimMode.BLOCK

    def copy_shared(self, records: Sequence[ScheduledRequest]) -> None:
        """After the step's evictions, before the repacks: every request of ``records``
        whose repack would write a block another request also holds gets a block of its own
        in its place (all allocated before any reference is dropped, so no block read by a
        copy of this step is handed out as another copy's destination), and drops its
        reference to the shared one; its record remembers the shared block (``copied``)
        for :meth:`copy_moves`. Blocks the repack only empties are released by it."""
        wanted: list[tuple[ScheduledRequest, list[int]]] = []
        for record in records:
            record.copied = {}
            table = record.kv.table
            holes = np.flatnonzero(~table.live_mask)
            if not holes.size or self.config.mode is ReclaimMode.BLOCK:
                continue
            first = int(holes[0]) // self.block_size
            self.manager.own_from(record.kv.request_id, first)
            kept = [i for i in self.shared_indices(record, first) if i < table.num_ideal_blocks]
            if kept:
                wanted.append((record, kept))
        if not wanted:
            return
        fresh = self.pool.allocate(sum(len(indices) for _, indices in wanted))
        dropped: list[int] = []
        for record, indices in wanted:
            new_ids, fresh = fresh[: len(indices)], fresh[len(indices) :]
            old_ids = self.manager.replace_blocks(record.kv.request_id, indices, new_ids)
            blocks = self.stm.req_to_blocks[record.kv.request_id]
            for index, block in zip(indices, self.pool.blocks(new_ids), strict=True):
                blocks[index] = block
            record.copied = dict(zip(indices, old_ids, strict=True))
            dropped += old_ids
        self.pool.free(dropped)  # a reference each: the other holders keep the blocks

    def copy_moves(
        self, record: ScheduledRequest, plan: RepackPlan
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The repack's moves with the copies of :meth:`copy_shared` folded in (global
        slots, after the reclaim committed ``plan``): every live slot of a copied block
        comes from the shared block (where a move fills it, from the move's source, read
        from the shared block if it lay in one). No destination is also a source: the
        destinations are the request's holes and its new blocks, the sources its live
        slots and the shared blocks. Returns ``(src, dst, group_ids)``: a grouped plan's
        copies are folded per group (each group's own moves), ``group_ids`` then names
        each move's group (else ``None``)."""
        if not record.copied:
            return plan.src_slots, plan.dst_slots, plan.group_ids
        if plan.group_ids is None:
            return (*self._fold(record, plan, np.ones(plan.num_moves, dtype=bool)), None)
        parts = []
        for group in range(record.kv.table.num_groups):
            src, dst = self._fold(record, plan, plan.group_ids == group)
            parts.append((src, dst, np.full(src.size, group, dtype=np.int64)))
        src, dst, groups = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        return src, dst, groups

    def _fold(
        self, record: ScheduledRequest, plan: RepackPlan, pick: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`copy_moves` for the plan's moves ``pick`` (one group's, or all)."""
        size, table = self.block_size, record.kv.table
        old = {index: block * size for index, block in record.copied.items()}

        def from_shared(local: np.ndarray, slots: np.ndarray) -> np.ndarray:
            index = local // size
            base = np.array([old.get(int(i), -1) for i in index], dtype=np.int64)
            return np.where(base >= 0, base + local % size, slots)

        src = from_shared(plan.src_local[pick], plan.src_slots[pick])
        moved = set(plan.dst_local[pick].tolist())
        stay = np.array(
            [
                slot
                for index in record.copied
                for slot in range(index * size, min((index + 1) * size, plan.num_slots_after))
                if slot not in moved
            ],
            dtype=np.int64,
        )
        stay_src = from_shared(stay, table.global_slots(stay))
        dst = np.concatenate([plan.dst_slots[pick], table.global_slots(stay)])
        return np.concatenate([src, stay_src]), dst

    def pinned_hit(self, record: ScheduledRequest, under_pressure: bool) -> int:
        """Tokens of its cache hit the request keeps for life (``pin_cache_hits``): none
        under a bound admission or the controller set (``hold_blocks``, a tenant's cap,
        pressure): those bounds come first."""
        if not self.config.pin_cache_hits or record.capped or record.hold_blocks is not None:
            return 0
        return 0 if under_pressure else record.hit_tokens

    def unpublish_changed(self, record: ScheduledRequest) -> None:
        """After an eviction, before its repack: drop from the prefix cache the published
        blocks from the first one it touches that only this request holds (a shared one
        stays intact and cached: the request copies it, :meth:`copy_shared`), and publish
        nothing past it again."""
        table = record.kv.table
        holes = np.flatnonzero(~table.live_mask)  # this step's evictions (repacked before)
        if not holes.size:
            return
        first = int(holes[0]) // self.block_size
        request_id = record.kv.request_id
        published = self.stm.num_cached_block.get(request_id, 0)
        if published > first:
            sole = [b for b in table.block_ids[first:published] if self.pool.ref_count(b) == 1]
            self.pool.unpublish(sole)
            self.stm.num_cached_block[request_id] = first
        if record.cacheable is None or record.cacheable > first * self.block_size:
            record.cacheable = first * self.block_size

    def check_invariants(self, record: ScheduledRequest) -> None:
        """Published and protected prefixes are live and in place (what their hashes say);
        nothing is published past what the request may publish; only published blocks are
        shared."""
        kv = record.kv
        num_published = self.stm.num_cached_block.get(kv.request_id, 0) * self.block_size
        for name, length in (("published", num_published), ("protected", kv.num_pinned)):
            assert kv.table.holds_in_place(length), f"{name} token moved or lost"
        if record.cacheable is not None:
            assert num_published <= record.cacheable, f"{kv.request_id}: published past"
        reach = num_published // self.block_size
        shared = [i for i, b in enumerate(kv.table.block_ids) if self.pool.ref_count(b) > 1]
        assert all(i < reach for i in shared), f"{kv.request_id}: shares unpublished blocks"

    def check_holders(self, records: Iterable[ScheduledRequest]) -> None:
        """vLLM's reference counts are the holders (several only for shared blocks), and
        each shared block is charged once."""
        holders: dict[int, int] = {}
        for record in records:
            for block_id in record.kv.table.block_ids + record.kv.ballast:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id, count in holders.items():
            assert self.pool.ref_count(block_id) == count, f"block {block_id}: ref count"
        charged = sum(report.allocated_blocks for report in self.manager.reports())
        assert charged == len(holders), "a shared block is charged other than once"
