"""`vtoken bench quotas`: its workload and its over-budget arithmetic (the real-stack run
itself is the benchmark; `tests/e2e` covers the stack)."""

from __future__ import annotations

import json

import pytest

from bench.quotas import (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    BenchTenant,
    make_arrivals,
    mode_settings,
    plot,
    scaled,
)
from serving.demo import over_budget

TENANTS = (BenchTenant("a", 10, rate_rps=2.0), BenchTenant("b", 20, rate_rps=0.5))


def passages() -> list[list[int]]:
    return [list(range(1500)), list(range(2000, 3100))]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_arrivals_are_seeded_sorted_and_within_the_workload_ranges() -> None:
    first = make_arrivals(TENANTS, 100.0, seed=3, passages=passages(), decode=decode)
    assert first == make_arrivals(TENANTS, 100.0, seed=3, passages=passages(), decode=decode)
    assert first != make_arrivals(TENANTS, 100.0, seed=4, passages=passages(), decode=decode)
    assert [a.at_s for a in first] == sorted(a.at_s for a in first)
    assert all(0 <= a.at_s < 100.0 for a in first)
    for arrival in first:
        assert PROMPT_TOKENS[0] <= arrival.prompt_tokens <= PROMPT_TOKENS[1]
        assert OUTPUT_TOKENS[0] <= arrival.max_tokens <= OUTPUT_TOKENS[1]
        assert len(arrival.prompt.split()) == arrival.prompt_tokens  # a contiguous cut
    counts = {t.tenant_id: sum(a.tenant_id == t.tenant_id for a in first) for t in TENANTS}
    # Poisson counts around rate x duration (200 and 50): far from each other
    assert 150 < counts["a"] < 250 and 25 < counts["b"] < 80
    assert {a.stream for a in first} == {True, False}


def test_load_scales_the_arrival_rates_and_keeps_the_budgets() -> None:
    doubled = scaled(TENANTS, 2.0)
    assert [(t.tenant_id, t.budget_blocks, t.rate_rps) for t in doubled] == [
        ("a", 10, 4.0),
        ("b", 20, 1.0),
    ]
    base = make_arrivals(TENANTS, 100.0, seed=3, passages=passages(), decode=decode)
    more = make_arrivals(doubled, 100.0, seed=3, passages=passages(), decode=decode)
    assert 1.6 < len(more) / len(base) < 2.4


def test_over_budget_sums_and_finds_the_longest_stretch() -> None:
    samples = [(0.0, 5), (0.1, 12), (0.3, 11), (0.4, 9), (1.0, 15), (1.1, 10), (2.0, 30)]
    total, longest = over_budget(samples, budget=10)
    # above at 0.1-0.4 (0.3 s) and 1.0-1.1 (0.1 s); the last sample has no duration
    assert total == pytest.approx(0.4) and longest == pytest.approx(0.3)
    assert over_budget(samples, budget=100) == (0.0, 0.0)
    assert over_budget([], budget=1) == (0.0, 0.0)


def test_modes_differ_in_admission_and_eviction_only() -> None:
    assert mode_settings("worst_case", 0.2) == (
        "worst_case",
        {"policy": "h2o", "keep_ratio": 0.2, "eviction": "eager"},
    )
    assert mode_settings("active_kv", 0.2) == (
        "active_kv",
        {"policy": "h2o", "keep_ratio": 0.2, "eviction": "on_demand"},
    )


def test_plot_draws_each_mode(tmp_path) -> None:
    tenant = {"id": "a", "budget_blocks": 10, "requests_ok": 3, "active_blocks_series": [[0, 1]]}
    summary = {"modes": {m: {"tenants": [tenant], "requests_ok": 3} for m in ("x", "y")}}
    path = tmp_path / "quotas.png"
    plot(json.loads(json.dumps(summary)), path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_stretches_are_judged_against_a_report_period_plus_the_step() -> None:
    from bench.quotas import judge_stretches
    from serving.demo import over_budget_stretches

    samples = [(0.0, 5), (0.1, 12), (0.3, 11), (0.4, 9), (1.0, 15), (1.5, 10), (2.0, 30)]
    stretches = over_budget_stretches(samples, budget=10)
    assert stretches == [(0.1, 0.4), (1.0, 1.5)]  # the last sample has no duration
    hosts = [(t, frozenset({"r1"})) for t, _ in samples]
    steps = {
        "r1": [(-1.0, 0.05), (0.15, 0.4)],  # a 0.25 s step inside the first stretch
        "r2": [(0.9, 1.6)],  # a long step on a replica that does not hold the tenant
    }
    first, second = judge_stretches(stretches, hosts, steps, report_period_s=0.1)
    assert first.step_s == 0.25 and first.bound_s == pytest.approx(0.35)
    assert first.within_bound and first.replicas == ["r1"]
    assert second.step_s == 0.0 and not second.within_bound  # 0.5 s > 0.1 s
    # A long step that ended before the stretch began does not excuse it...
    early = judge_stretches([(1.0, 1.5)], hosts, {"r1": [(0.0, 0.99)]}, 0.1)[0]
    assert not early.within_bound
    # ...one that ran during it does, on a replica holding the tenant's KV.
    hosts_both = [(1.2, frozenset({"r1", "r2"}))]
    during = judge_stretches([(1.0, 1.5)], hosts_both, steps, 0.1)[0]
    assert during.within_bound and during.step_s == pytest.approx(0.7)
