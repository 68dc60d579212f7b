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

``naive`` mode: the same decisions and the same physical compaction (so attention is
identical), but the request also holds *ballast* blocks from the pool so that it holds
exactly as many blocks as a block-granular manager would: one per logical block
(``logical_id // block_size``) that still contains a live token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from vtoken.manager import VTokenManager
from vtoken.policy import ScoreNeeds, StepAttention
from vtoken.repack_planner import ReclaimMode
from workers.config import PolicySpec, VTokenConfig, request_policy_spec
from workers.counters import RequestCounters, TenantCounters, as_dict, finished_copy
from workers.messages import StepOps, StepScores
from workers.vllm_block_pool import VLLMBlockPool

DEFAULT_TENANT = "default"
MAX_FINISHED_RECORDS = 4096


class VTokenScheduler:
    """Token tables, policies and block accounting of one engine core.

    ``single_type_manager`` is vLLM's ``FullAttentionManager`` (its ``req_to_blocks`` is
    kept equal to the tables' block ids). Invariants in ``check_invariants``.
    """

    def __init__(self, config: VTokenConfig, block_pool: Any, single_type_manager: Any) -> None:
        self.config = config
        self.pool = VLLMBlockPool(block_pool)
        self.block_size = int(single_type_manager.block_size)
        self.stm = single_type_manager
        self.manager = VTokenManager(self.pool, self.block_size, ReclaimMode.VTOKEN)
        self.specs: dict[str, PolicySpec] = {}
        self.ballast: dict[str, list[int]] = {}
        self.pending_moves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.pending_num_blocks: dict[str, int] = {}
        self.evictions: dict[str, list[np.ndarray]] = {}
        self.finished: OrderedDict[str, RequestCounters] = OrderedDict()
        self.finished_evictions: OrderedDict[str, list[np.ndarray]] = OrderedDict()
        self.num_preemptions = 0
        self.blocks_reclaimed = 0  # blocks given back mid-request by evictions + repacks

    @property
    def naive(self) -> bool:
        return self.config.mode is ReclaimMode.NAIVE

    def manages(self, request_id: str) -> bool:
        return request_id in self.manager.requests

    # ------------------------------------------------------------------ allocation
    def allocate(self, request: Any, num_new_tokens: int, reserve: int = 0) -> list[Any] | None:
        """Blocks for ``num_new_tokens`` more tokens of ``request`` (vLLM ``Request``), or
        ``None`` when the pool cannot give them while keeping ``reserve`` blocks free."""
        request_id = request.request_id
        if request_id not in self.manager.requests:
            self._add(request)
        table = self.manager.requests[request_id].table
        assert table.num_logical == request.num_computed_tokens, (
            f"{request_id}: table has {table.num_logical} tokens, vLLM computed "
            f"{request.num_computed_tokens}"
        )
        num_new_blocks = table.num_blocks_needed(num_new_tokens)
        ballast_delta = 0
        if self.naive:
            target = self._naive_blocks(table, num_new_tokens) - len(table.block_ids)
            ballast_delta = target - num_new_blocks - len(self.ballast[request_id])
        if num_new_blocks + max(ballast_delta, 0) + reserve > self.pool.num_free_blocks:
            return None
        block_ids = self.pool.allocate(num_new_blocks)
        table.append(num_new_tokens, block_ids)
        blocks = self.pool.blocks(block_ids)
        self.stm.req_to_blocks[request_id].extend(blocks)
        if self.stm.records_new_block_ids:
            self.stm.new_block_ids.extend(block_ids)
        self._resize_ballast(request_id, len(self.ballast.get(request_id, ())) + ballast_delta)
        return blocks

    def blocks_needed_for(self, num_tokens: int) -> int:
        """Blocks a fresh request needs for ``num_tokens`` tokens (admission check)."""
        return -(-num_tokens // self.block_size)

    def _add(self, request: Any) -> None:
        params = request.sampling_params
        extra = (params.extra_args if params is not None else None) or {}
        tenant = str(extra.get("tenant", DEFAULT_TENANT))
        # A bad override never gets here: the front end and the engine core's add path
        # refuse the request (``workers/vllm_patches.py``, request admission).
        spec = request_policy_spec(extra) or self.config
        self.specs[request.request_id] = spec
        self.manager.add_request(
            request.request_id, request.num_prompt_tokens, tenant, spec.make_policy()
        )
        self.stm.req_to_blocks[request.request_id]  # defaultdict: create the empty list
        self.ballast[request.request_id] = []
        if self.config.record_evictions:
            self.evictions[request.request_id] = []

    def _naive_blocks(self, table: Any, num_new_tokens: int = 0) -> int:
        """Logical blocks holding a live token once ``num_new_tokens`` more are appended."""
        live = table.live_logical_ids() // self.block_size
        new = np.arange(table.num_logical, table.num_logical + num_new_tokens) // self.block_size
        return int(np.unique(np.concatenate([live, new])).size)

    def _resize_ballast(self, request_id: str, size: int) -> None:
        ballast = self.ballast.get(request_id)
        if ballast is None or size == len(ballast):
            return
        if size > len(ballast):
            ballast += self.pool.allocate(size - len(ballast))
        else:
            self.pool.free(ballast[size:])
            del ballast[size:]

    # ------------------------------------------------------------------ steps
    def after_step(
        self,
        num_scheduled_tokens: dict[str, int],
        requests: dict[str, Any],
        scores: StepScores | None,
    ) -> None:
        """Run the policies of the requests that ran this step, commit repacks, free blocks."""
        attention_of = scores.attention if scores is not None else {}
        for request_id in num_scheduled_tokens:
            entry = self.manager.requests.get(request_id)
            request = requests.get(request_id)
            if entry is None or request is None:
                continue
            attention = attention_of.get(request_id, StepAttention())
            if request.num_computed_tokens < request.num_tokens:
                self.manager.observe(request_id, attention)  # a prefill chunk: no eviction yet
                continue
            budget = self.specs[request_id].budget(entry.table.num_logical)
            evicted = self.manager.evict(request_id, budget, attention)
            if self.config.record_evictions:
                self.evictions[request_id].append(evicted)
            held_before = self._held_blocks(request_id)
            self._reclaim(request_id)
            self.blocks_reclaimed += max(0, held_before - self._held_blocks(request_id))
        if self.config.check_invariants:
            self.check_invariants()

    def _held_blocks(self, request_id: str) -> int:
        table = self.manager.requests[request_id].table
        return len(table.block_ids) + len(self.ballast.get(request_id, ()))

    def _reclaim(self, request_id: str) -> None:
        table = self.manager.requests[request_id].table
        plan = self.manager.plan(request_id)
        if plan.is_empty:
            # Only tail tokens died, in a block still needed: shorten without moving (the
            # manager skips empty plans, but the physical count must drop).
            table.move(plan.src_local, plan.dst_local, plan.num_slots_after)
            if self.naive:
                self._resize_ballast(request_id, self._naive_blocks(table) - len(table.block_ids))
            return
        self.manager.reclaim([request_id])  # commits the table, frees the emptied blocks
        if plan.num_moves:
            src, dst = self.pending_moves.get(request_id, (_EMPTY, _EMPTY))
            self.pending_moves[request_id] = (
                np.concatenate([src, plan.src_slots]),
                np.concatenate([dst, plan.dst_slots]),
            )
        num_kept = len(table.block_ids)
        vllm_blocks = self.stm.req_to_blocks[request_id]
        del vllm_blocks[num_kept:]
        self.pending_num_blocks[request_id] = num_kept
        if self.naive:
            self._resize_ballast(request_id, self._naive_blocks(table) - num_kept)

    def take_ops(self, num_scheduled_tokens: dict[str, int], requests: dict[str, Any]) -> StepOps:
        """The ops the workers apply before this step's forward (see ``StepOps``)."""
        num_evicted, score_needs = {}, {}
        for request_id in num_scheduled_tokens:
            entry = self.manager.requests.get(request_id)
            if entry is None:
                continue
            table = entry.table
            assert table.num_logical == requests[request_id].num_computed_tokens
            num_evicted[request_id] = table.num_logical - table.num_slots
            needs = entry.policy.score_needs() if entry.policy is not None else ScoreNeeds()
            if needs.any:
                score_needs[request_id] = needs
        moves = list(self.pending_moves.values())
        ops = StepOps(
            src_slots=np.concatenate([m[0] for m in moves]) if moves else _EMPTY,
            dst_slots=np.concatenate([m[1] for m in moves]) if moves else _EMPTY,
            num_blocks=dict(self.pending_num_blocks),
            num_evicted=num_evicted,
            score_needs=score_needs,
        )
        self.pending_moves.clear()
        self.pending_num_blocks.clear()
        return ops

    # ------------------------------------------------------------------ lifecycle
    def free(self, request_id: str, preempted: bool = False) -> None:
        """Finish, abort or preemption: every block goes back, the table is dropped.

        A preempted request starts over with a fresh table (and policy) when it resumes:
        vLLM recomputes its whole sequence.
        """
        counters = self.request_counters(request_id)
        if preempted:
            self.num_preemptions += 1
        else:
            self.finished[request_id] = finished_copy(counters)
        if request_id in self.evictions:
            self.finished_evictions[request_id] = self.evictions.pop(request_id)
        while len(self.finished) > MAX_FINISHED_RECORDS:
            self.finished.popitem(last=False)
        while len(self.finished_evictions) > MAX_FINISHED_RECORDS:
            self.finished_evictions.popitem(last=False)
        self.manager.free_request(request_id)
        del self.specs[request_id]
        self._resize_ballast(request_id, 0)
        del self.ballast[request_id]
        self.pending_moves.pop(request_id, None)
        self.pending_num_blocks.pop(request_id, None)
        self.stm.pop_blocks_for_free(request_id)  # vLLM's bookkeeping; blocks already freed

    # ------------------------------------------------------------------ counters
    def request_snapshot(self, request_id: str) -> dict[str, Any] | None:
        """One request's counters as plain data: running, or among the recently finished.

        ``request_id`` may be the client's id: vLLM's front end appends ``-<8 chars>`` to
        it for the engine core, so the most recent request with that prefix is returned.
        """

        def matches(engine_id: str) -> bool:
            return engine_id == request_id or engine_id.rpartition("-")[0] == request_id

        for engine_id in reversed(self.manager.requests):
            if matches(engine_id):
                return as_dict(self.request_counters(engine_id))
        for engine_id in reversed(self.finished):
            if matches(engine_id):
                return as_dict(self.finished[engine_id])
        return None

    def request_counters(self, request_id: str) -> RequestCounters:
        entry = self.manager.requests[request_id]
        table = entry.table
        return RequestCounters(
            request_id=request_id,
            tenant=entry.tenant,
            policy=self.specs[request_id].policy,
            live_tokens=table.num_live,
            allocated_blocks=table.num_held_blocks + len(self.ballast[request_id]),
            ideal_blocks=table.num_ideal_blocks,
            evicted_tokens=entry.num_evicted,
            repack_moves=entry.num_moves,
        )

    def snapshot(self) -> dict[str, Any]:
        """Plain-data counters of the engine (crosses processes as a utility result)."""
        return {
            "mode": self.config.mode.value,
            "policy": self.config.policy,
            "block_size": self.block_size,
            "total_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.num_free_blocks,
            "num_preemptions": self.num_preemptions,
            "blocks_reclaimed": self.blocks_reclaimed,
            "naive_equivalent_blocks": sum(
                self._naive_blocks(entry.table) for entry in self.manager.requests.values()
            ),
            "requests": [as_dict(c) for c in self.all_request_counters()],
            "tenants": {t: as_dict(c) for t, c in self.tenant_counters().items()},
        }

    def all_request_counters(self) -> list[RequestCounters]:
        return [self.request_counters(request_id) for request_id in self.manager.requests]

    def tenant_counters(self) -> dict[str, TenantCounters]:
        totals: dict[str, list[int]] = {}
        for c in self.all_request_counters():
            row = totals.setdefault(c.tenant, [0] * 6)
            values = (1, c.live_tokens, c.allocated_blocks, c.ideal_blocks)
            for i, value in enumerate((*values, c.evicted_tokens, c.repack_moves)):
                row[i] += value
        return {tenant: TenantCounters(tenant, *row) for tenant, row in totals.items()}

    def check_invariants(self) -> None:
        held: list[int] = []
        for request_id, entry in self.manager.requests.items():
            table = entry.table
            table.check_invariants()
            vllm_ids = [block.block_id for block in self.stm.req_to_blocks[request_id]]
            assert vllm_ids == table.block_ids, f"{request_id}: vLLM blocks != token table"
            assert table.num_slots == table.num_live, f"{request_id}: not repacked"
            assert table.num_held_blocks == len(table.block_ids) == table.num_ideal_blocks
            if self.naive:
                naive = self._naive_blocks(table)
                assert len(self.ballast[request_id]) == max(0, naive - len(table.block_ids))
            held += table.held_block_ids + self.ballast[request_id]
        assert len(set(held)) == len(held), "a block is held twice"
        assert 0 not in held, "the null block was handed out"
        # Every request of a vToken engine has a table, so nothing else holds blocks.
        assert len(held) + self.pool.num_free_blocks == self.pool.num_blocks, "blocks leaked"


_EMPTY = np.zeros(0, dtype=np.int64)
