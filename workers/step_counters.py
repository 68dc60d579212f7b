"""The engine's counters since start, as the scheduler side reports them."""

from __future__ import annotations

from dataclasses import dataclass

from workers.squeeze import SqueezeCause


@dataclass(slots=True)
class StepCounters:
    """Preemptions, evictions by cause (request-steps that evicted at least one token) and
    the worker's repack totals (its cumulative figures, the latest kept)."""

    num_preemptions: int = 0
    # evicted for room (on_demand), for a tenant's allowance or under controller pressure
    num_evictions_under_pressure: int = 0
    # evicted to stay within what admission counts (``hold_blocks``)
    num_evictions_to_bound: int = 0
    num_evictions_below_budget: int = 0  # squeezed under their budgets
    # asked to evict at a step that was not scored (``workers/score_timing.py``): none
    num_evictions_unscored: int = 0
    num_scored_request_steps: int = 0  # request-steps whose attention statistics were asked
    num_shared_copies: int = 0  # shared blocks a request copied to evict from (copy on evict)
    # request-steps that kept their shared blocks this step: no free block to copy them into
    num_copies_deferred: int = 0
    repack_bytes_total: int = 0
    repack_seconds_total: float = 0.0

    def count_eviction(self, cause: SqueezeCause | None) -> None:
        """One request evicted this step for ``cause`` (``None``: it was not squeezed)."""
        if cause is SqueezeCause.BELOW_BUDGET:
            self.num_evictions_below_budget += 1
            self.num_evictions_under_pressure += 1
        elif cause is SqueezeCause.UNDER_PRESSURE:
            self.num_evictions_under_pressure += 1
        elif cause is SqueezeCause.TO_BOUND:
            self.num_evictions_to_bound += 1

    def take_repack_totals(self, repack_bytes_total: int, repack_seconds_total: float) -> None:
        """The worker's cumulative repack totals of this step (monotone: the latest kept)."""
        self.repack_bytes_total = max(self.repack_bytes_total, repack_bytes_total)
        self.repack_seconds_total = max(self.repack_seconds_total, repack_seconds_total)
