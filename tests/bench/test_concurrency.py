"""The concurrency search (no engine): doubling then bisection finds the largest N."""

from __future__ import annotations

import pytest

from bench.concurrency import Trial, max_concurrency


@pytest.mark.parametrize(
    ("capacity", "limit"), [(0, 64), (1, 64), (5, 64), (13, 64), (64, 64), (40, 30)]
)
def test_search_finds_the_largest_served_n(capacity, limit):
    tried = []

    def run(n: int) -> Trial:
        tried.append(n)
        return Trial(served=n <= capacity, peak_running=n, preempted=n > capacity, tokens_per_s=n)

    best, rate = max_concurrency(run, limit)
    assert best == min(capacity, limit)
    assert rate == best
    assert len(tried) <= 2 * limit.bit_length() + 1
