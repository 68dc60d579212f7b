"""Which requests a step scores: attention statistics cost a pass over every scored layer,
so in ``on_demand`` mode they are computed only where the step may end in an eviction.

Decided when the step is scheduled (its ``StepOps`` carry the score needs), for the
eviction decided after its forward (``VTokenScheduler.after_step``). Between the two
nothing allocates, so the blocks free then are at least those free now, and the head of
the waiting queue is the same. A request may evict after the step when

- the eviction mode is ``eager`` (every request evicts to its budget every step);
- something bounds it whatever memory holds (:attr:`StepRequest.bounded`): its policy's own
  timing (SnapKV, PAGE), a tenant's cap, its tenant's pressure, or its next block would
  pass what admission counts it at (``hold_blocks``);
- memory may bind (:func:`memory_may_bind`): the running requests' next step and the
  head of the waiting queue may need more blocks than are free. Counted from above (a
  decoding request one block, a prompt its next chunk and a block), so no step that the
  squeeze planner will ask for room goes unscored.

A policy whose statistics accumulate (``observes_every_step``: H2O's cumulative mass) is
scored at every step anyway (``EvictionPolicy.needs_at_step``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kernels.intmath import cdiv


@dataclass(frozen=True, slots=True)
class StepRequest:
    """What the timing reads of one running request when its step is scheduled.

    ``num_remaining``: prompt tokens still to compute after this step (0 once it decodes);
    ``bounded``: it evicts at the end of the step whatever memory holds."""

    num_remaining: int
    bounded: bool = False


def next_step_blocks_at_most(
    num_remaining: int, block_size: int, max_step_tokens: int | None
) -> int:
    """The most blocks a running request may open in the step after this one: one for a
    decoding request, its next prompt chunk and a partial block for a prompt in prefill."""
    if num_remaining <= 0:
        return 1
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
        next_step_blocks_at_most(r.num_remaining, block_size, max_step_tokens) for r in running
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
