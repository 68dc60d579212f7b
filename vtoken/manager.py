"""The vToken manager: token tables, policies and block accounting for many requests.

It is engine-agnostic: an engine (the transformers reference engine, or vLLM through the
plugin in ``workers/``) calls ``allocate`` before a forward, ``evict`` after it with the
step's attention statistics, and ``reclaim`` to repack and give blocks back to the pool.
The manager changes only tables and the pool: the engine copies the KV of each returned
plan (``src_slots`` to ``dst_slots``) before its next forward reads or writes them.

``vtoken`` and ``naive`` make the same decisions and keep the same physical layout (every
reclaim repacks). They differ only in what a request holds::

    logical ids   0  1  2  3 | 4  5  6  7 | 8  9          block_size 4, . = evicted
    live          x  .  .  . | .  .  x  . | x  x
    vtoken        |0  6  8  9|                            ceil(4 / 4) = 1 block
    naive         |0  6  8  9| + 2 ballast blocks         logical blocks 0, 1, 2 = 3 blocks

In ``naive`` mode (Naive-Evict, the paired baseline) a request also holds *ballast*
blocks from the pool, so that it holds exactly what a block-granular manager must: one
block per logical block that still holds a live token (``TokenTable.num_naive_blocks``).

In ``block`` mode (block-granular eviction, the baseline paged engines ship) the policy
drops whole blocks (``vtoken/block_eviction.py``) and a reclaim frees them without copies
(``plan_block_drop``): its plans never move a token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kernels.intmath import cdiv
from vtoken.block_eviction import num_protected_blocks, select_blocks
from vtoken.block_pool import BlockPool
from vtoken.groups import ModelGeometry
from vtoken.policy import EvictionPolicy, PolicyView, StepAttention
from vtoken.repack_planner import ReclaimMode, RepackPlan, plan_block_drop, plan_repack
from vtoken.reports import DEFAULT_TENANT, RequestReport
from vtoken.token_table import TokenTable


@dataclass(slots=True)
class RequestKV:
    """One request's token table, its policy, its ballast (naive mode) and its counters."""

    request_id: str
    tenant: str
    prompt_len: int
    table: TokenTable
    policy: EvictionPolicy | None
    ballast: list[int] = field(default_factory=list)
    num_shared_blocks: int = 0  # leading blocks adopted from the prefix cache
    num_pinned: int = 0  # leading tokens the engine pins: its policy protects them as sinks
    num_steps: int = 0
    num_evicted: int = 0
    num_moves: int = 0

    @property
    def num_held_blocks(self) -> int:
        return len(self.table.block_ids) + len(self.ballast)


class VTokenManager:
    """Owns a ``TokenTable`` per request; allocates from and frees to ``pool``.

    Invariants (``check_invariants``): no block is held twice, except blocks that several
    requests share from the start of their tables (``adopt``: prefix-cache hits); distinct
    held + free == the pool's blocks (the manager owns the whole pool); a request holds
    ballast only in naive mode, at least what Naive-Evict needs (exactly that after
    ``allocate`` and ``reclaim``).
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        mode: ReclaimMode = ReclaimMode.VTOKEN,
        geometry: ModelGeometry | None = None,
    ) -> None:
        """``geometry``: the model's layers and KV heads, for policies that keep a set per
        layer or per (layer, KV head) (``vtoken/groups.py``); ``None`` refuses them."""
        self.pool = pool
        self.block_size = block_size
        self.mode = ReclaimMode(mode)
        self.geometry = geometry
        self.requests: dict[str, RequestKV] = {}
        self.num_blocks_reclaimed = 0  # given back by reclaims while requests still ran
        self.num_evicted_tokens = 0  # since start, every request's (finished ones too)
        self.num_repack_moves = 0  # token copies the repacks planned, since start

    def add_request(
        self,
        request_id: str,
        prompt_len: int,
        tenant: str = DEFAULT_TENANT,
        policy: EvictionPolicy | None = None,
    ) -> RequestKV:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        stat_names = policy.stat_names if policy is not None else ()
        table = TokenTable(self.block_size, stat_names, self._group_shape(policy))
        request = RequestKV(request_id, tenant, prompt_len, table, policy)
        self.requests[request_id] = request
        return request

    def _group_shape(self, policy: EvictionPolicy | None) -> tuple[int, ...]:
        granularity = "request" if policy is None else policy.granularity
        if granularity == "request":
            return ()
        if self.geometry is None:
            raise ValueError(f"granularity {granularity!r} needs the model's geometry")
        if self.mode is ReclaimMode.BLOCK:
            raise ValueError("block mode drops whole blocks of one set: granularity 'request'")
        return self.geometry.group_shape(granularity)

    def allocate(self, request_id: str, num_new_tokens: int, reserve: int = 0) -> list[int] | None:
        """Room for ``num_new_tokens`` more tokens: returns the blocks added to the table
        (possibly none), or ``None`` when the pool cannot give them (ballast included) while
        keeping ``reserve`` blocks free; then nothing changed."""
        request = self.requests[request_id]
        table = request.table
        num_new_blocks = table.num_blocks_needed(num_new_tokens)
        ballast_delta = self._ballast_size(table, num_new_tokens) - len(request.ballast)
        if num_new_blocks + max(ballast_delta, 0) + reserve > self.pool.num_free_blocks:
            return None
        block_ids = self.pool.allocate(num_new_blocks)
        table.append(num_new_tokens, block_ids)
        self._resize_ballast(request, len(request.ballast) + ballast_delta)
        return block_ids

    def adopt(self, request_id: str, block_ids: list[int]) -> None:
        """Start a request's empty table with full blocks another request computed (a
        prefix-cache hit): their tokens are its first ``len(block_ids) * block_size``
        logical ids, at the same slots. The caller took its reference on the blocks (they
        are not allocated from the pool) and must keep those tokens where they are: it
        never lets the request's policy evict them (``workers/prefix_cache.py``)."""
        request = self.requests[request_id]
        if request.table.num_logical or request.ballast:
            raise ValueError(f"request {request_id!r}: only an empty table adopts blocks")
        request.table.append(len(block_ids) * self.block_size, list(block_ids))
        request.num_shared_blocks = len(block_ids)

    def own_from(self, request_id: str, first: int) -> None:
        """The request's blocks from index ``first`` on are its own from now (an eviction
        touches them: it copies those another request holds, ``replace_blocks``, and the
        repack releases the rest it empties): its adopted prefix ends there."""
        request = self.requests[request_id]
        request.num_shared_blocks = min(request.num_shared_blocks, first)

    def replace_blocks(
        self, request_id: str, indices: list[int], block_ids: list[int]
    ) -> list[int]:
        """Copy on evict: the request's blocks at ``indices`` become ``block_ids`` (the
        caller allocated them, copies the tokens and drops the request's reference to the
        old ones, which it returns). Slots, tokens and stats stay where they are."""
        table = self.requests[request_id].table
        old = [table.block_ids[i] for i in indices]
        for index, block_id in zip(indices, block_ids, strict=True):
            table.block_ids[index] = block_id
        return old

    def view(self, request_id: str, attention: StepAttention | None = None) -> PolicyView:
        request = self.requests[request_id]
        table = request.table
        return PolicyView(
            logical_ids=table.view_logical_ids(),
            num_logical=table.num_logical,
            prompt_len=request.prompt_len,
            step=request.num_steps,
            stats=table.view_stats(),
            attention=attention if attention is not None else StepAttention(),
            num_pinned=request.num_pinned,
        )

    def evict(
        self, request_id: str, budget: int, attention: StepAttention | None = None
    ) -> np.ndarray:
        """Finish a step: run the request's policy for ``budget`` live tokens and evict
        (in block mode, whole blocks: :func:`~vtoken.block_eviction.select_blocks`).

        Returns the evicted logical ids (empty without a policy).
        """
        request = self.requests[request_id]
        request.num_steps += 1
        if request.policy is None:
            return np.zeros(0, dtype=np.int64)
        view = self.view(request_id, attention)
        if self.mode is ReclaimMode.BLOCK:
            live_slots = request.table.live_slots()
            evicted = select_blocks(request.policy, view, budget, self.block_size, live_slots)
        else:
            evicted = request.policy.select(view, budget)
        request.table.store_stats(view.stats)
        self.evict_ids(request_id, evicted)
        return evicted

    def observe(self, request_id: str, attention: StepAttention | None = None) -> None:
        """Feed a step's attention to the request's policy without evicting (e.g. a prefill
        chunk that does not yet complete the prompt); stats are stored back, no step counted."""
        request = self.requests[request_id]
        if request.policy is None:
            return
        view = self.view(request_id, attention)
        request.policy.observe(view)
        request.table.store_stats(view.stats)

    def evict_ids(self, request_id: str, logical_ids: np.ndarray) -> None:
        """Evict explicit logical ids (for engines or tests that decide elsewhere): ``[k]``,
        or ``[num_groups, k]`` in a grouped table (``TokenTable.evict``)."""
        request = self.requests[request_id]
        request.table.evict(logical_ids)
        count = int(np.asarray(logical_ids).shape[-1])
        request.num_evicted += count
        self.num_evicted_tokens += count

    def plan(self, request_id: str) -> RepackPlan:
        table = self.requests[request_id].table
        return plan_block_drop(table) if self.mode is ReclaimMode.BLOCK else plan_repack(table)

    def reclaim(self, request_ids: Iterable[str] | None = None) -> list[RepackPlan]:
        """Repack the given requests (default: all), free the blocks that emptied and, in
        naive mode, the ballast Naive-Evict no longer needs. Returns one plan per request,
        in order; the engine copies their moves before its next forward.

        Dead tokens own no slot afterwards, even when no block is freed and nothing moves
        (dead tail tokens: the slot count just drops). In block mode nothing moves: dead
        blocks leave the table wherever they are (``ValueError`` if a dead token shares a
        block with live ones, see ``plan_block_drop``).
        """
        ids = list(self.requests) if request_ids is None else list(request_ids)
        plans = []
        for request_id in ids:
            request = self.requests[request_id]
            held_before = request.num_held_blocks
            plan = self.plan(request_id)
            if self.mode is ReclaimMode.BLOCK:
                released = request.table.drop_blocks(plan.free_block_indices, plan.num_slots_after)
            else:
                released = request.table.move(
                    plan.src_local, plan.dst_local, plan.num_slots_after, plan.group_ids
                )
            assert released == plan.free_block_ids
            if released:
                self.pool.free(released)
            self._resize_ballast(request, self._ballast_size(request.table))
            request.num_moves += plan.num_moves
            self.num_repack_moves += plan.num_moves
            self.num_blocks_reclaimed += max(0, held_before - request.num_held_blocks)
            plans.append(plan)
        return plans

    def free_request(self, request_id: str) -> RequestKV:
        """Finish, abort or preemption: every held block goes back; returns the entry."""
        request = self.requests.pop(request_id)
        if request.table.block_ids:
            self.pool.free(request.table.block_ids)
        self._resize_ballast(request, 0)
        return request

    def charged_elsewhere(self) -> dict[str, int]:
        """Per request, how many blocks it holds that are charged to another request: a
        block several requests share (a prefix-cache hit) is charged once, to its earliest
        current holder (the request that computed it, or after that one finished the
        earliest that adopted it). So a tenant's requests that share blocks count them
        once, and requests sum to the distinct blocks held."""
        shared = {
            b for r in self.requests.values() for b in r.table.block_ids[: r.num_shared_blocks]
        }
        if not shared:
            return {}
        charged: set[int] = set()
        elsewhere: dict[str, int] = {}
        for request_id, request in self.requests.items():  # in the order they were added
            mine = [b for b in request.table.block_ids if b in shared]
            elsewhere[request_id] = sum(1 for b in mine if b in charged)
            charged.update(mine)
        return elsewhere

    def report(
        self,
        request_id: str,
        budget_tokens: int | None = None,
        charged_elsewhere: int | None = None,
    ) -> RequestReport:
        """The request's usage; ``budget_tokens`` (the live tokens its policy may keep now,
        ``None`` while nothing can be evicted, e.g. in prefill) sets its floor: the blocks
        its budget, or the tokens its policy protects if more, would fill. The floor is its
        ideal (a pending repack's blocks are reclaimable) without a budget or under a
        policy that does not evict to its budget whenever asked (``none``; SnapKV and PAGE
        decide once), and what it holds in naive mode (eviction frees no block there). In
        block mode what the policy protects counts in whole blocks
        (:func:`~vtoken.block_eviction.num_protected_blocks`).

        Blocks charged to another request (``charged_elsewhere``, default: computed) leave
        its ``allocated``, ``ideal``, ``floor`` and ``naive`` counts alike (they are
        pinned, so inside every one of them) and show as ``shared_blocks``."""
        if charged_elsewhere is None:
            charged_elsewhere = self.charged_elsewhere().get(request_id, 0)
        request = self.requests[request_id]
        table = request.table
        frees = self.mode is not ReclaimMode.NAIVE
        # A pending repack's freed blocks count as reclaimable (the ideal, not what it holds).
        floor = table.num_ideal_blocks if frees else request.num_held_blocks
        policy = request.policy
        # Only a policy that evicts to its budget whenever asked can bring it lower.
        evicts = policy is not None and policy.holds_budget_every_step and policy.needs_budget
        if budget_tokens is not None and evicts and frees:
            assert policy is not None
            if self.mode is ReclaimMode.BLOCK:
                protected = num_protected_blocks(
                    policy.protection(), budget_tokens, request.num_pinned, self.block_size
                )
                keep = max(cdiv(budget_tokens, self.block_size), protected) * self.block_size
            else:
                keep = max(budget_tokens, policy.num_protected(budget_tokens, request.num_pinned))
            floor = min(floor, cdiv(min(table.num_live, keep), self.block_size))
        shared = charged_elsewhere
        return RequestReport(
            request_id=request_id,
            tenant=request.tenant,
            policy=request.policy.name if request.policy is not None else None,
            live_tokens=table.num_live,
            allocated_blocks=request.num_held_blocks - shared,
            ideal_blocks=table.num_ideal_blocks - shared,
            floor_blocks=floor - shared,
            naive_blocks=table.num_naive_blocks() - shared,
            shared_blocks=shared,
            evicted_tokens=request.num_evicted,
            repack_moves=request.num_moves,
        )

    def reports(self, budgets: Mapping[str, int] | None = None) -> tuple[RequestReport, ...]:
        """Every running request's report (``budgets``: request id -> budget tokens)."""
        budgets = budgets or {}
        elsewhere = self.charged_elsewhere()
        return tuple(self.report(r, budgets.get(r), elsewhere.get(r, 0)) for r in self.requests)

    def _ballast_size(self, table: TokenTable, num_new_tokens: int = 0) -> int:
        """Ballast Naive-Evict needs once ``num_new_tokens`` more are appended (0 in vtoken
        mode): its logical blocks minus the blocks the packed table will hold."""
        if self.mode is not ReclaimMode.NAIVE:
            return 0
        num_table_blocks = cdiv(table.num_slots + num_new_tokens, self.block_size)
        return max(0, table.num_naive_blocks(num_new_tokens) - num_table_blocks)

    def _resize_ballast(self, request: RequestKV, size: int) -> None:
        ballast = request.ballast
        if size > len(ballast):
            ballast += self.pool.allocate(size - len(ballast))
        elif size < len(ballast):
            self.pool.free(ballast[size:])
            del ballast[size:]

    def check_invariants(self) -> None:
        held: list[int] = []
        adopted: set[int] = set()
        for request in self.requests.values():
            request.table.check_invariants()
            assert len(request.ballast) >= self._ballast_size(request.table), "ballast short"
            assert self.mode is ReclaimMode.NAIVE or not request.ballast
            shared = request.table.block_ids[: request.num_shared_blocks]
            adopted.update(shared)
            held += request.table.block_ids[request.num_shared_blocks :] + request.ballast
        # A block one request computed may be adopted by others (it is then held once
        # in ``held`` and again in ``adopted``); any other block has one holder.
        assert len(set(held)) == len(held), "a block is held twice"
        distinct = set(held) | adopted
        free = self.pool.num_free_blocks + self.pool.num_blocks_elsewhere
        assert len(distinct) + free == self.pool.num_blocks, "blocks leaked"
