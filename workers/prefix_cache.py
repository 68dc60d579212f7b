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
  config: a tenant's system prompt stays cacheable however hard the request is
  squeezed) and, at each eviction, every block another request holds too (reference
  count > 1: a block it took from a cache hit while its first holder still runs, or one
  of its own that a later request took). Its policy protects them as sinks for that
  eviction (``RequestKV.num_pinned``), so no eviction or repack writes a block another
  request reads, and no hit ever reads a block that changed. A block it took from the
  cache that nobody else holds any more is its own: evicting in it unpublishes it like
  any other, unless the engine pins cache hits (``pin_cache_hits``: they stay protected
  and cached for the request's life, outside its policy's budget; not for a resumed
  request, whose hit is its own sequence, nor under a hard bound). (vLLM itself drops a
  cached block's hash when it hands the block out again.)
- a shared block is charged once, to its earliest current holder
  (``VTokenManager.charged_elsewhere``); the others count it neither against their
  budget nor against ``hold_blocks`` (a request's budget is in the tokens it pays for).
  With ``pin_cache_hits`` a request keeps its cache hit on top of its policy's budget,
  unless a hard bound applies to it (``hold_blocks``, a tenant's cap, pressure).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kernels.intmath import cdiv
from vtoken.manager import VTokenManager
from workers.config import VTokenConfig
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
        cache hit of ``pinned_hit`` tokens) and every block another request also holds
        (only published blocks are shared: hits take them from the start)."""
        policy = record.kv.policy
        if policy is None or not policy.evicts:
            return
        request_id = record.kv.request_id
        blocks = self.stm.req_to_blocks[request_id]
        published = min(self.stm.num_cached_block.get(request_id, 0), len(blocks))
        shared = [i for i in range(published) if blocks[i].ref_cnt > 1]
        reach = (shared[-1] + 1) * self.block_size if shared else 0
        self.protect(record, max(self.config.prefix_pin_tokens, reach, pinned_hit))

    def pinned_hit(self, record: ScheduledRequest, under_pressure: bool) -> int:
        """Tokens of its cache hit the request keeps for life (``pin_cache_hits``): none
        under a bound admission or the controller set (``hold_blocks``, a tenant's cap,
        pressure): those bounds come first."""
        if not self.config.pin_cache_hits or record.capped or record.hold_blocks is not None:
            return 0
        return 0 if under_pressure else record.hit_tokens

    def unpublish_changed(self, record: ScheduledRequest) -> None:
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

    def check_invariants(self, record: ScheduledRequest) -> None:
        """Published and protected prefixes are live and in place (what their hashes say);
        nothing is published past what the request may publish; only published blocks are
        shared."""
        kv = record.kv
        num_published = self.stm.num_cached_block.get(kv.request_id, 0) * self.block_size
        for name, length in (("published", num_published), ("protected", kv.num_pinned)):
            n = min(length, kv.table.num_logical)
            in_place = np.arange(n)
            assert (kv.table.live_slots()[:n] == in_place).all(), f"{name} token moved"
            assert (kv.table.live_logical_ids()[:n] == in_place).all(), f"{name} token lost"
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
