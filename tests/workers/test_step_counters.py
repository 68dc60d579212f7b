"""The engine's counters by eviction cause."""

from __future__ import annotations

from workers.squeeze import SqueezeCause
from workers.step_counters import StepCounters


def test_each_cause_adds_to_its_counters():
    counters = StepCounters()
    for cause in (*SqueezeCause, None):
        counters.count_eviction(cause)
    assert counters.num_evictions_below_budget == 1
    assert counters.num_evictions_under_pressure == 2  # below budget counts here too
    assert counters.num_evictions_to_bound == 1


def test_repack_totals_keep_the_latest_cumulative_figures():
    counters = StepCounters()
    counters.take_repack_totals(100, 0.5)
    counters.take_repack_totals(40, 0.25)  # an older rank's figure: not a step back
    assert (counters.repack_bytes_total, counters.repack_seconds_total) == (100, 0.5)
