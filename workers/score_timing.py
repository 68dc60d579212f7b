"""Which requests a step scores: attention statistics cost a pass over every scored layer,
so in ``on_demand`` mode they are computed only where the step may end in an eviction.

Decided when the step is scheduled (its ``StepOps`` carry the score needs), for the
eviction decided after its forward (``VTokenScheduler.after_step``). Between the two
nothing allocates, so the blocks free then are at least those free now, and the head of
the waiting queue is the same. A request may evict after the step when

- the eviction mode is ``eager`` (every request evicts to its budget every step);
- something bounds it whatever memory holds (:attr:`StepRequest.bounded`): its policy's own
  timing (SnapKV, PAGE) at the step that completes its prompt, a tenant's cap, its
  tenant's pressure, its tenant's allowance here (what its requests hold and may open next
  passes it), or its next step would pass what admission counts it at (``hold_blocks``);
- memory may bind (:func:`memory_may_bind`; not in naive mode, where evicting frees no
  block): the running requests' next step and the
  head of the waiting queue may need more blocks than are free. Counted from above (a
  decoding request one block, a prompt its next chunk and a block), so no step that the
  squeeze planner will ask for room goes unscored.

A policy whose statistics accumulate (``observes_every_step``: H2O's cumulative mass) is
scored at every step anyway (``EvictionPolicy.needs_at_step``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kernels.intmath import cdiv
from vtoken.repack_planner import ReclaimMode
from workers.config import VTokenConfig
from workers.scheduled_request import ScheduledRequest
from workers.tenant_pressure import TenantPressure


@dataclass(frozen=True, slots=True)
class StepRequest:
    """What the timing reads of one running request when its step is scheduled.

    ``num_remaining``: prompt tokens still to compute after this step (0 once it decodes);
    ``bounded``: it evicts at the end of the step whatever memory holds."""

    num_remaining: int
    bounded: bool = False
    num_free_slots: int = 0


def next_step_blocks_at_most(
    num_remaining: int, block_size: int, max_step_tokens: int | None, num_free_slots: int = 0
) -> int:
    """The most blocks a running request may open in the step after this one. Decoding:
    one token (speculative decoding is refused), so a block only when its blocks are full
    (``num_free_slots``: slots left in them after this step). In prefill: its next prompt
    chunk and a partial block."""
    if num_remaining <= 0:
        return 0 if num_free_slots > 0 else 1
    chunk = num_remaining if max_step_tokens is None else min(num_remaining, max_step_tokens)
    return cdiv(chunk, block_size) + 1


def memory_may_bind(
    num_free_blocks: int,
    num_waiting_blocks: int,
    running: Iterable[StepRequest],
    block_size: int,
    max_step_tokens: int | None,
) -> bool:
    """Whether the step after this one may need more blocks than are free now: what the
    head of the waiting queue needs to start plus what every running request may open."""
    need = num_waiting_blocks + sum(
        next_step_blocks_at_most(r.num_remaining, block_size, max_step_tokens, r.num_free_slots)
        for r in running
    )
    return need > num_free_blocks


def may_evict(
    scheduled: Iterable[str],
    running: dict[str, StepRequest],
    *,
    eager: bool,
    tight: bool,
) -> frozenset[str]:
    """The scheduled requests that may evict at the end of this step (``tight``:
    :func:`memory_may_bind`)."""
    return frozenset(
        request_id
        for request_id in scheduled
        if request_id in running and (eager or tight or running[request_id].bounded)
    )


@dataclass(frozen=True, slots=True)
class ScoreTiming:
    """The timing of one engine core (``max_step_tokens``: vLLM's token budget of a step)."""

    config: VTokenConfig
    block_size: int
    tenants: TenantPressure
    max_step_tokens: int | None

    def may_evict(
        self,
        records: Mapping[str, ScheduledRequest],
        requests: Mapping[str, Any],
        num_scheduled_tokens: Mapping[str, int],
        num_free_blocks: int,
        num_waiting_blocks: int,
    ) -> frozenset[str]:
        """The scheduled requests that may evict after this step (``records``' shared
        block counts current; ``requests``: vLLM's, whose computed counts already include
        the tokens this step schedules)."""
        remaining = {
            request_id: max(
                0, requests[request_id].num_tokens - requests[request_id].num_computed_tokens
            )
            for request_id in records
            if request_id in requests
        }
        free_slots = {
            request_id: len(records[request_id].kv.table.block_ids) * self.block_size
            - records[request_id].kv.table.num_slots
            for request_id in remaining
        }
        opens = {
            request_id: next_step_blocks_at_most(
                left, self.block_size, self.max_step_tokens, free_slots[request_id]
            )
            for request_id, left in remaining.items()
        }
        over_allowance = self._over_allowance(records, opens)
        running = {
            request_id: StepRequest(
                num_remaining=left,
                num_free_slots=free_slots[request_id],
                bounded=self._bounded(records[request_id], left, opens[request_id])
                or records[request_id].kv.tenant in over_allowance,
            )
            for request_id, left in remaining.items()
        }
        eager = self.config.eviction == "eager"
        frees_blocks = self.config.mode is not ReclaimMode.NAIVE
        tight = (
            not eager
            and frees_blocks
            and memory_may_bind(
                num_free_blocks,
                num_waiting_blocks,
                running.values(),
                self.block_size,
                self.max_step_tokens,
            )
        )
        return may_evict(num_scheduled_tokens, running, eager=eager, tight=tight)

    def _bounded(self, record: ScheduledRequest, num_remaining: int, num_opens: int) -> bool:
        """It evicts after this step whatever memory holds: its policy's own timing at the
        step that completes its prompt, a tenant's cap or pressure, or its next step
        (``num_opens`` blocks at most) past what admission counts it at."""
        policy = record.kv.policy
        own_timing = policy is not None and not policy.holds_budget_every_step
        hold = record.hold_blocks
        at_hold = hold is not None and record.paid_blocks + num_opens > hold
        under_pressure = self.tenants.applies_to(record.kv.tenant)
        return (own_timing and num_remaining == 0) or record.capped or at_hold or under_pressure

    def _over_allowance(
        self, records: Mapping[str, ScheduledRequest], opens: Mapping[str, int]
    ) -> set[str]:
        """Tenants whose requests here may hold more than their allowance after this step:
        the blocks they pay for and the most their running requests open next."""
        allowance = self.tenants.allowance
        if not allowance:
            return set()
        held: dict[str, int] = {}
        for request_id, record in records.items():
            tenant = record.kv.tenant
            held[tenant] = held.get(tenant, 0) + record.paid_blocks + opens.get(request_id, 0)
        return {t for t, limit in allowance.items() if held.get(t, 0) > limit}
