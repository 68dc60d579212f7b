"""The squeeze planner takes first from tenants above their weighted share of the pool,
and reads the scheduler's own victim (plain views, no engine)."""

from __future__ import annotations

from tests.workers.test_squeeze import planner, view


def _views() -> dict:
    # a holds 3 requests x 5 blocks, b one request of 5 blocks: 20 blocks of a 24-block
    # pool; equal weights give each a share of 12, a is 3 above it
    return {
        "a1": view(20, 20, tenant="a"),
        "a2": view(20, 20, tenant="a"),
        "a3": view(20, 20, tenant="a"),
        "b1": view(20, 20, tenant="b"),
    }


def _fair(views: dict, **settings):
    weights = settings.pop("tenant_weights", {"a": 1.0, "b": 1.0})
    return planner(views, tenant_weights=weights, pool_blocks=24, **settings)


def test_excess_over_share_counts_the_blocks_held():
    assert _fair(_views()).excess_over_share() == {"a": 15 - 12}
    assert planner(_views()).excess_over_share() == {}  # fairness off: no weights
    # weights 1 and 5: a's share is 4 blocks
    assert _fair(_views(), tenant_weights={"a": 1.0, "b": 5.0}).excess_over_share() == {"a": 11}


def test_below_budget_takes_from_the_tenant_above_its_share_first():
    views = {"x1": view(20, 20, tenant="b"), "y1": view(20, 20, tenant="a")}
    # unfair: the fullest share gives first (x1 before y1 on a tie), shares stay level
    assert planner(views).below_budget(["x1", "y1"], 1) == {"x1": 19}
    assert planner(views).below_budget(["x1", "y1"], 3) == {"x1": 15, "y1": 19}
    # weights 1 and 3 on 8 blocks: a's share is 2, it holds 5; b's is 6, it holds 5
    fair = planner(views, tenant_weights={"a": 1.0, "b": 3.0}, pool_blocks=8)
    above = fair.excess_over_share()
    assert above == {"a": 3}
    assert fair.below_budget(["x1", "y1"], 1, above=above) == {"y1": 19}
    assert fair.below_budget(["x1", "y1"], 3, above=above) == {"y1": 11}  # to its floor
    # past a's floor, b gives
    assert fair.below_budget(["x1", "y1"], 4, above=above) == {"y1": 11, "x1": 19}


def test_the_plan_squeezes_the_tenant_above_its_share():
    views = _views()
    needs = planner(views).plan(list(views), num_waiting_blocks=0)  # 4 blocks short
    assert set(needs.below) == {"a1", "a2", "a3", "b1"}  # level shares: one block each
    fair = _fair(views).plan(list(views), num_waiting_blocks=0)
    assert set(fair.below) == {"a1", "a2", "a3"}  # a, above its share, gives all 4
    # with a single tenant the plan is today's
    one = {r: view(20, 20, tenant="a") for r in views}
    assert _fair(one, tenant_weights={"a": 1.0}).plan(list(one), 0) == planner(one).plan(
        list(one), 0
    )


def test_room_at_budget_is_asked_first_of_the_tenant_above_its_share():
    views = {"b1": view(40, 20, tenant="b"), "a1": view(32, 20, tenant="a")}
    # b1 gives more room (11 - 6 = 5 blocks) than a1 (9 - 6 = 3): without fairness it goes
    assert planner(views).plan(["b1", "a1"], 0).for_room == {"b1"}
    fair = planner(views, tenant_weights={"a": 1.0, "b": 3.0}, pool_blocks=20)  # a: 8 > 5
    assert fair.plan(["b1", "a1"], 0).for_room == {"a1"}


def test_the_likely_victim_is_the_last_of_the_schedulers_order():
    views = _views()
    plan = planner(views)
    assert plan.likely_victim(set())[0] == "b1"  # vLLM's order: the newest
    ordered = planner(views, victim_order=["b1", "a1", "a2", "a3"])
    assert ordered.likely_victim(set())[0] == "a3"
    assert ordered.likely_victim({"a3"})[0] == "a2"  # ending with this step: not a victim
