"""The vToken manager: token tables, policies and block accounting for many requests.

It is engine-agnostic: an engine (the transformers simulator, or vLLM through the plugin
in ``workers/``) calls ``allocate`` before a forward, ``evict`` after it with the step's
attention statistics, and ``reclaim`` to repack and give blocks back to the pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from vtoken.block_pool import BlockPool, NoFreeBlocksError
from vtoken.policy import EvictionPolicy, PolicyView, StepAttention
from vtoken.reclaimer import Reclaimer
from vtoken.repack_planner import ReclaimMode, RepackPlan, plan_repack
from vtoken.reports import BlockReport, request_report, tenant_reports
from vtoken.token_table import TokenTable


@dataclass(slots=True)
class RequestKV:
    """One request's token table, its policy and its counters."""

    request_id: str
    tenant: str
    prompt_len: int
    table: TokenTable
    policy: EvictionPolicy | None
    num_steps: int = 0
    num_evicted: int = 0
    num_moves: int = 0


class VTokenManager:
    """Owns a ``TokenTable`` per request; allocates from and frees to ``pool``."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        mode: ReclaimMode = ReclaimMode.VTOKEN,
        reclaimer: Reclaimer | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.mode = ReclaimMode(mode)
        self.reclaimer = reclaimer if reclaimer is not None else Reclaimer(pool)
        if self.reclaimer.pool is not pool:
            raise ValueError("the reclaimer must free into the manager's pool")
        self.requests: dict[str, RequestKV] = {}

    def add_request(
        self,
        request_id: str,
        prompt_len: int,
        tenant: str = "default",
        policy: EvictionPolicy | None = None,
    ) -> RequestKV:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        stat_names = policy.stat_names if policy is not None else ()
        request = RequestKV(
            request_id, tenant, prompt_len, TokenTable(self.block_size, stat_names), policy
        )
        self.requests[request_id] = request
        return request

    def allocate(self, request_id: str, num_new_tokens: int) -> np.ndarray | None:
        """Global slots for the next ``num_new_tokens`` tokens, or ``None`` if the pool is short."""
        table = self.requests[request_id].table
        try:
            new_blocks = self.pool.allocate(table.num_blocks_needed(num_new_tokens))
        except NoFreeBlocksError:
            return None
        return table.global_slots(table.append(num_new_tokens, new_blocks))

    def view(self, request_id: str, attention: StepAttention | None = None) -> PolicyView:
        request = self.requests[request_id]
        table = request.table
        live_slots = table.live_slots()
        return PolicyView(
            logical_ids=table.live_logical_ids(),
            num_logical=table.num_logical,
            prompt_len=request.prompt_len,
            step=request.num_steps,
            stats={name: values[live_slots].copy() for name, values in table.stats.items()},
            attention=attention if attention is not None else StepAttention(),
        )

    def evict(
        self, request_id: str, budget: int, attention: StepAttention | None = None
    ) -> np.ndarray:
        """Finish a step: run the request's policy for ``budget`` live tokens and evict.

        Returns the evicted logical ids (empty without a policy).
        """
        request = self.requests[request_id]
        request.num_steps += 1
        if request.policy is None:
            return np.zeros(0, dtype=np.int64)
        view = self.view(request_id, attention)
        evicted = request.policy.select(view, budget)
        live_slots = request.table.live_slots()
        for name, values in view.stats.items():
            request.table.stats[name][live_slots] = values
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
        live_slots = request.table.live_slots()
        for name, values in view.stats.items():
            request.table.stats[name][live_slots] = values

    def evict_ids(self, request_id: str, logical_ids: np.ndarray) -> None:
        """Evict explicit logical ids (for engines or tests that decide elsewhere)."""
        request = self.requests[request_id]
        request.table.evict(logical_ids)
        request.num_evicted += int(np.asarray(logical_ids).size)

    def plan(self, request_id: str) -> RepackPlan:
        return plan_repack(self.requests[request_id].table, self.mode)

    def reclaim(self, request_ids: Iterable[str] | None = None) -> list[RepackPlan]:
        """Repack (vtoken) or drop dead blocks (naive) for the given requests (default: all)."""
        ids = list(self.requests) if request_ids is None else list(request_ids)
        batch = []
        for request_id in ids:
            request = self.requests[request_id]
            plan = plan_repack(request.table, self.mode)
            if not plan.is_empty:
                request.num_moves += plan.num_moves
                batch.append((request.table, plan))
        self.reclaimer.apply(batch)
        return [plan for _, plan in batch]

    def free_request(self, request_id: str) -> None:
        """Finish or abort: every held block goes back (after in-flight copies complete)."""
        request = self.requests.pop(request_id)
        self.reclaimer.release(request.table.held_block_ids)

    def report(self, request_id: str) -> BlockReport:
        return request_report(self.requests[request_id].table)

    def tenant_reports(self) -> dict[str, BlockReport]:
        return tenant_reports((r.tenant, r.table) for r in self.requests.values())

    def check_invariants(self) -> None:
        held: list[int] = []
        for request in self.requests.values():
            request.table.check_invariants()
            held += request.table.held_block_ids
        assert len(set(held)) == len(held), "a block is held by two requests"
        in_use = len(held) + self.reclaimer.num_pending_blocks
        assert in_use + self.pool.num_free_blocks == self.pool.num_blocks, "blocks leaked"
