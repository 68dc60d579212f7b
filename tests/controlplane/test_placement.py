from __future__ import annotations

from collections import Counter

import pytest

from controlplane.models import ReplicaReport, RoutingPlan, TenantQuota
from controlplane.placement import PlanInputs, PlannerConfig, PlanResult, compute_plan
from controlplane.pressure import MIN_KEEP_FRACTION
from tests.controlplane.builders import quota, report

CONFIG = PlannerConfig(high_watermark=0.9, low_watermark=0.75, hot_tenant_fraction=0.25)
NEVER_HOT = PlannerConfig(high_watermark=0.9, low_watermark=0.75, hot_tenant_fraction=1.0)


def plan_once(
    reports: list[ReplicaReport],
    quotas: list[TenantQuota],
    previous: RoutingPlan | None = None,
    stale: frozenset[str] = frozenset(),
    config: PlannerConfig = CONFIG,
) -> PlanResult:
    version = previous.version + 1 if previous is not None else 0
    inputs = PlanInputs(
        version=version,
        fence=1,
        now_s=10.0,
        reports={r.replica_id: r for r in reports},
        stale_ids=stale,
        quotas={q.tenant_id: q for q in quotas},
        previous=previous,
    )
    return compute_plan(inputs, config)


def homes(plan: RoutingPlan) -> dict[str, list[str]]:
    return {t: [w.replica_id for w in route.replicas] for t, route in plan.tenants.items()}


def test_idle_tenants_spread_one_replica_each() -> None:
    result = plan_once(
        [report(f"r{i}", 10.0) for i in range(4)], [quota(f"t{i}") for i in range(8)]
    )
    placed = homes(result.plan)
    assert all(len(replicas) == 1 for replicas in placed.values())
    assert Counter(r for replicas in placed.values() for r in replicas) == {
        f"r{i}": 2 for i in range(4)
    }
    assert result.plan.replica_ids == ("r0", "r1", "r2", "r3")
    assert all(route.replicas[0].weight == 1.0 for route in result.plan.tenants.values())


def test_stale_and_draining_replicas_leave_the_plan() -> None:
    first = plan_once([report("r1", 10.0), report("r2", 10.0)], [quota("a"), quota("b")])
    on_r2 = [t for t, rs in homes(first.plan).items() if rs == ["r2"]]
    second = plan_once(
        [report("r1", 10.0)], [quota("a"), quota("b")], first.plan, frozenset({"r2"})
    )
    assert second.plan.drained_replica_ids == ("r2",)
    assert all(rs == ["r1"] for rs in homes(second.plan).values())
    assert second.num_moves == len(on_r2) == 1
    third = plan_once(
        [report("r1", 10.0), report("r2", 10.0, draining=True)], [quota("a")], second.plan
    )
    assert third.plan.replica_ids == ("r1",) and third.plan.drained_replica_ids == ("r2",)


def test_rebalancing_moves_off_an_overloaded_replica_without_flapping() -> None:
    quotas = [quota("a", 1000), quota("b", 1000), quota("c", 1000)]
    initial = plan_once([report("r1", 10.0), report("r2", 10.0)], quotas, config=NEVER_HOT)
    pinned = _pin(initial.plan, {"a": "r1", "b": "r1", "c": "r2"})
    # a grows: r1 at 95% > high mark. a is the largest tenant there, so it moves.
    overloaded = [report("r1", 10.0, {"a": 50, "b": 45}), report("r2", 10.0, {"c": 10})]
    moved = plan_once(overloaded, quotas, pinned, config=NEVER_HOT)
    assert homes(moved.plan) == {"a": ["r2"], "b": ["r1"], "c": ["r2"]}
    assert moved.num_moves == 1
    # While a's old requests finish on r1, r1 still reports them: nothing moves back.
    transition = plan_once(overloaded, quotas, moved.plan, config=NEVER_HOT)
    assert homes(transition.plan) == homes(moved.plan) and transition.num_moves == 0
    # Settled on r2 with r1 nearly empty: a stays where it is (hysteresis).
    settled_reports = [report("r1", 10.0, {"b": 45}), report("r2", 10.0, {"a": 50, "c": 10})]
    after = moved.plan
    for _ in range(3):
        result = plan_once(settled_reports, quotas, after, config=NEVER_HOT)
        assert homes(result.plan) == homes(moved.plan) and result.num_moves == 0
        after = result.plan


def test_no_move_when_every_other_replica_would_overload() -> None:
    quotas = [quota("a", 1000), quota("b", 1000)]
    initial = plan_once([report("r1", 10.0), report("r2", 10.0)], quotas, config=NEVER_HOT)
    previous = _pin(initial.plan, {"a": "r1", "b": "r2"})
    reports = [report("r1", 10.0, {"a": 95}), report("r2", 10.0, {"b": 70})]
    result = plan_once(reports, quotas, previous, config=NEVER_HOT)
    assert homes(result.plan) == {"a": ["r1"], "b": ["r2"]} and result.num_moves == 0


def test_hot_tenant_gets_a_warm_set_and_shrinks_with_hysteresis() -> None:
    reports = [report(f"r{i}", 10.0) for i in range(5)]
    quotas = [quota("hot", 10_000), quota("cold")]
    hot_reports = [report("r0", 10.0, {"hot": 60}), *reports[1:]]
    hot = plan_once(hot_reports, quotas)
    assert len(hot.plan.tenants["hot"].replicas) == 3  # ceil(60 / (0.25 * 100))
    assert sum(w.weight for w in hot.plan.tenants["hot"].replicas) == pytest.approx(1.0)
    assert len(hot.plan.tenants["cold"].replicas) == 1
    # Demand falls to 20: 3 replicas are kept until demand < half of what 2 would need.
    cooler = plan_once([report("r0", 10.0, {"hot": 20}), *reports[1:]], quotas, hot.plan)
    assert len(cooler.plan.tenants["hot"].replicas) == 2
    assert set(homes(cooler.plan)["hot"]) < set(homes(hot.plan)["hot"])


def test_over_budget_tenant_gets_eviction_pressure() -> None:
    reports = [report("r1", 10.0, {"a": 40, "b": 5}), report("r2", 10.0, {"a": 20})]
    result = plan_once(reports, [quota("a", budget=45), quota("b", budget=10)])
    assert result.usage_blocks == {"a": 60, "b": 5}
    assert result.plan.tenants["a"].over_budget and not result.plan.tenants["b"].over_budget
    pressure = result.plan.pressure
    assert set(pressure) == {"r1", "r2"} and set(pressure["r1"]) == {"a"}
    # 45 / 60 of what it holds, less the headroom that keeps regrowth under the budget
    assert pressure["r1"]["a"].keep_fraction == pytest.approx(0.9 * 0.75)
    assert (pressure["r1"]["a"].target_blocks, pressure["r2"]["a"].target_blocks) == (27, 13)
    assert 27 + 13 < 45


def test_admission_is_charged_floors_while_pressure_follows_what_tenants_hold() -> None:
    # On-demand requests of "a" hold 60 blocks, but eviction to their budgets gives back 45.
    reports = [
        report("r1", 10.0, {"a": 40, "b": 5}, floors={"a": 10}),
        report("r2", 10.0, {"a": 20}, floors={"a": 5}),
    ]
    result = plan_once(reports, [quota("a", budget=45), quota("b", budget=10)])
    assert result.usage_blocks == {"a": 15, "b": 5}
    assert result.plan.tenants["a"].usage_blocks == 60 and result.plan.tenants["a"].over_budget
    assert set(result.plan.pressure) == {"r1", "r2"}


def test_allowances_split_each_budget_by_where_the_tenant_holds_kv() -> None:
    reports = [
        report("r1", 10.0, {"over": 40, "under": 5}),
        report("r2", 10.0, {"over": 20}),
        report("r3", 10.0, {"gone": 7}),
    ]
    quotas = [quota("over", budget=45), quota("under", budget=20), quota("idle", budget=12)]
    plan = plan_once(reports, quotas).plan
    allowance = plan.allowance
    # over budget: 45 of the 60 it holds -> 3/4 of what it holds on each replica
    assert (allowance["r1"]["over"], allowance["r2"]["over"]) == (30, 15)
    # within budget: what it holds, plus its slack (15 and 12) shared over its warm set by
    # routing weight, so the replicas its new requests go to have room for them
    for tenant_id, held, budget in (("under", {"r1": 5}, 20), ("idle", {}, 12)):
        route = plan.tenants[tenant_id].replicas
        for weight in route:
            expected = held.get(weight.replica_id, 0) + int(
                (budget - sum(held.values())) * weight.weight
            )
            assert allowance[weight.replica_id][tenant_id] == expected
        shares = [a[tenant_id] for a in allowance.values() if tenant_id in a]
        assert budget - len(route) < sum(shares) <= budget
    assert all("gone" not in a for a in allowance.values())  # deleted: no limit, drains


def test_a_hybrid_tenants_windows_count_but_only_its_full_attention_blocks_are_squeezed() -> None:
    """A tenant on a hybrid model holds 60 blocks, 20 of them in sliding-window groups the
    engine never evicts from. Its active KV is all 60; pressure asks for a fraction of the
    other 40 that brings the total to 0.9 x 45 (40.5), and allowances leave the windows
    out (the engine holds the full-attention group to them)."""
    reports = [
        report("r1", 10.0, {"a": 40}, windows={"a": 15}),
        report("r2", 10.0, {"a": 20}, windows={"a": 5}),
    ]
    plan = plan_once(reports, [quota("a", budget=45)]).plan
    assert plan.tenants["a"].usage_blocks == 60 and plan.tenants["a"].over_budget
    keep = plan.pressure["r1"]["a"].keep_fraction
    assert keep == pytest.approx((0.9 * 45 - 20) / 40)  # not 0.9 x 45 / 60
    targets = [plan.pressure[r]["a"].target_blocks for r in ("r1", "r2")]
    assert targets == [15 + int(25 * keep), 5 + int(15 * keep)]
    assert sum(targets) <= 0.9 * 45
    # over budget: 45 / 60 of what it holds there (30, 15), less its windows there
    assert (plan.allowance["r1"]["a"], plan.allowance["r2"]["a"]) == (30 - 15, 15 - 5)
    # Windows alone over the budget: the least keep fraction (what the policy protects).
    only_windows = [report("r1", 10.0, {"a": 60}, windows={"a": 50})]
    squeezed = plan_once(only_windows, [quota("a", budget=45)]).plan
    assert squeezed.pressure["r1"]["a"].keep_fraction == MIN_KEEP_FRACTION
    assert squeezed.allowance["r1"]["a"] == 0
    # Nothing but windows: nothing to evict, no pressure (and no division by zero).
    windows_only = [report("r1", 10.0, {"a": 60}, windows={"a": 60})]
    assert "a" not in plan_once(windows_only, [quota("a", budget=45)]).plan.pressure.get("r1", {})


def test_without_windows_pressure_keeps_its_fraction_however_small() -> None:
    """No sliding-window blocks: keep 0.9 x budget / usage, not clamped to
    MIN_KEEP_FRACTION (a budget of 1 block against 95 held)."""
    plan = plan_once([report("r1", 10.0, {"a": 95})], [quota("a", budget=1)]).plan
    assert plan.pressure["r1"]["a"].keep_fraction == pytest.approx(0.9 / 95)
    assert plan.pressure["r1"]["a"].target_blocks == 0


def test_no_live_replicas_gives_an_empty_plan() -> None:
    result = plan_once([], [quota("a")], stale=frozenset({"r1"}))
    assert result.plan.tenants == {} and result.plan.drained_replica_ids == ("r1",)


def test_bad_planner_config() -> None:
    with pytest.raises(ValueError, match="watermark"):
        PlannerConfig(high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValueError, match="hot_tenant_fraction"):
        PlannerConfig(hot_tenant_fraction=0)


def _pin(plan: RoutingPlan, placement: dict[str, str]) -> RoutingPlan:
    """`plan` with each tenant on exactly the given replica."""
    tenants = {
        t: route.model_copy(
            update={
                "replicas": (route.replicas[0].model_copy(update={"replica_id": placement[t]}),)
            }
        )
        for t, route in plan.tenants.items()
    }
    return plan.model_copy(update={"tenants": tenants})
