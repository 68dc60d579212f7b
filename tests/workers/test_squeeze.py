"""The squeeze planner on plain per-request views (no block pool, no engine)."""

from __future__ import annotations

from dataclasses import replace

from workers.squeeze import RequestView, SqueezeCause, SqueezePlan, SqueezePlanner

BLOCK_SIZE = 4


def view(num_live: int, budget: int, **fields) -> RequestView:
    """A decoding request whose ``num_live`` tokens fill its blocks exactly (its next token
    opens one), protecting nothing, holding only its own blocks."""
    num_blocks = -(-num_live // BLOCK_SIZE)
    defaults = {
        "tenant": "t",
        "num_blocks": num_blocks,
        "num_paid_blocks": num_blocks,
        "num_live": num_live,
        "num_next_token_blocks": 1 if num_live % BLOCK_SIZE == 0 else 0,
        "num_next_step_blocks": 1 if num_live % BLOCK_SIZE == 0 else 0,
        "budget": budget,
        "num_unbudgeted": 0,
        "protected_at": lambda budget: 0,
        "sole_blocks": lambda: num_blocks,
    }
    return RequestView(**{**defaults, **fields})


def planner(views: dict[str, RequestView], num_free_blocks: int = 0, **settings) -> SqueezePlanner:
    return SqueezePlanner(
        views,
        num_free_blocks=num_free_blocks,
        block_size=BLOCK_SIZE,
        allowance=settings.pop("allowance", {}),
        **settings,
    )


def test_room_is_counted_for_the_next_step():
    # 40 live tokens in 10 full blocks (+1 for the next token); budget 20: 5 full blocks,
    # and the next token opens a sixth.
    plan = planner({"a": view(40, 20)})
    assert plan.room("a") == 11 - 6
    assert plan.room("a", 19) == 11 - 5  # 19 and the next token fill 5 blocks
    assert plan.blocks_above_budget("a") == 10 - 5


def test_what_the_policy_protects_is_kept_past_the_budget():
    plan = planner({"a": view(40, 8, protected_at=lambda budget: 30)})
    assert plan.tokens_at("a", 8) == 30
    assert plan.blocks_above_budget("a") == 10 - 8
    capped = planner({"a": view(20, 8, protected_at=lambda budget: 30)})
    assert capped.tokens_at("a", 8) == 20  # never more than it holds


def test_nothing_is_room_in_naive_mode_or_for_a_policy_that_does_not_evict_to_budget():
    assert planner({"a": view(40, 20)}, frees_blocks=False).room("a") == 0
    keeps = planner({"a": view(40, 20, evicts_to_budget=False)})
    assert keeps.room("a") == 0 and keeps.blocks_above_budget("a") == 0
    assert keeps.below_budget(["a"], 3) == {}


def test_squeeze_order_most_blocks_above_budget_first():
    plan = planner({"a": view(40, 30), "b": view(40, 10), "c": view(40, 40)})
    assert plan.squeeze_order(["a", "b", "c"]) == ["b", "a"]


def test_eager_evicts_every_decoding_request_to_budget():
    views = {"a": view(40, 20), "b": view(40, 20, under_pressure=True)}
    plan = planner(views, eager=True).plan(["a", "b"], num_waiting_blocks=100)
    assert plan.always == {"a", "b"} and not plan.for_room and not plan.below
    assert plan.budgets == {"a": 20, "b": 20}
    assert plan.causes == {"a": SqueezeCause.OWN, "b": SqueezeCause.UNDER_PRESSURE}


def test_on_demand_evicts_only_for_the_room_it_needs():
    views = {"a": view(40, 20), "b": view(40, 36), "c": view(40, 40)}
    # each needs a block next step: 3 with 0 free; a gives 5, enough
    plan = planner(views).plan(["a", "b", "c"], num_waiting_blocks=0)
    assert plan.for_room == {"a"} and not plan.always and not plan.below
    assert plan.budgets == {"a": 20} and plan.causes == {"a": SqueezeCause.UNDER_PRESSURE}
    assert planner(views, num_free_blocks=3).plan(["a", "b", "c"], 0).budgets == {}
    # the waiting queue asks for room too: b gives its one block as well
    assert planner(views).plan(["a", "b", "c"], num_waiting_blocks=3).for_room == {"a", "b"}


def test_a_request_that_outgrows_its_hold_always_evicts_and_counts_to_bound():
    views = {"a": view(40, 20, hold_blocks=8)}  # 10 held + 1 next > 8
    assert views["a"].outgrows_hold and views["a"].evicts_every_step
    plan = planner(views, num_free_blocks=100).plan(["a"], 0)
    assert plan.always == {"a"} and plan.causes == {"a": SqueezeCause.TO_BOUND}
    within = replace(views["a"], hold_blocks=11)
    assert not within.outgrows_hold
    assert planner({"a": within}, num_free_blocks=100).plan(["a"], 0).budgets == {}


def test_a_request_ending_with_this_step_gives_its_blocks_back_instead():
    views = {"a": view(40, 20, ending=True, num_next_step_blocks=0), "b": view(40, 20)}
    plan = planner(views).plan(["a", "b"], num_waiting_blocks=5)  # a's 10 blocks cover it
    assert plan.budgets == {}


def test_below_budget_takes_one_block_at_a_time_from_the_fullest_share():
    # at budget, 20 tokens in 5 full blocks each, floors 10 (squeeze_floor 0.5)
    views = {"a": view(20, 20), "b": view(20, 20)}
    plan = planner(views)
    assert plan.below_budget(["a", "b"], 1) == {"a": 19}
    assert plan.below_budget(["a", "b"], 2) == {"a": 19, "b": 19}
    assert plan.below_budget(["a", "b"], 6) == {"a": 11, "b": 11}  # down to the floors
    assert plan.below_budget(["a", "b"], 7) == {}  # the floors cannot free 7: vLLM preempts
    assert plan.below_budget(["a", "b"], 7, victim=("c", 3)) == {"a": 15, "b": 15}
    assert planner(views, squeeze_below_budget=False).below_budget(["a", "b"], 1) == {}


def test_the_prefix_outside_the_budget_stays_out_of_the_share():
    # b's first 16 tokens are shared (paid for elsewhere): its own budget is 4 of 20
    views = {"a": view(20, 20), "b": view(20, 20, num_unbudgeted=16)}
    floor = planner(views)._floor("b")
    assert floor == 16 + 2
    assert planner(views).below_budget(["a", "b"], 2) == {"a": 15}


def test_a_tenant_above_its_allowance_gives_first():
    # level shares: the heap breaks the tie by id, so "a" would give first
    views = {"a": view(20, 20, tenant="y"), "b": view(20, 20, tenant="x")}
    plan = planner(views, allowance={"x": 2})
    assert plan.held_per_tenant() == {"y": 5, "x": 5}
    excess = plan.excess_over_allowance(set(), set())
    assert excess == {"x": 3}
    assert plan.below_budget(["a", "b"], 1, excess) == {"b": 19}
    assert plan.below_budget(["a", "b"], 1) == {"a": 19}


def test_a_tenant_over_its_allowance_evicts_to_budget_whatever_memory_holds():
    views = {"x1": view(40, 20, tenant="x"), "x2": view(40, 36, tenant="x")}
    plan = planner(views, num_free_blocks=100, allowance={"x": 16}).plan(["x1", "x2"], 0)
    assert plan.for_room == {"x1"}  # 20 held, 5 above budget: x1's 5 suffice


def test_the_likely_victim_is_the_newest_running_request():
    views = {
        "a": view(20, 20),
        "b": view(20, 20),
        "w": view(0, 0, num_blocks=0),  # its first allocation failed: waiting
        "gone": view(20, 20, running=False),
    }
    plan = planner(views)
    assert plan.likely_victim(set()) == ("b", 5 + 1)
    assert plan.likely_victim({"b"}) == ("a", 5 + 1)
    evicting = planner({"a": view(40, 20)}).likely_victim(set(), {"a"})
    assert evicting == ("a", 10 + 1 - 5)  # less what its eviction this step gives


def test_a_plan_names_the_cause_of_every_squeeze():
    views = {"a": view(20, 20), "b": view(20, 20, capped=True), "c": view(20, 20)}
    plan = SqueezePlan.of(views, always={"b"}, for_room={"c"}, below={"a": 15})
    assert plan.budgets == {"a": 15, "b": 20, "c": 20}
    assert plan.causes == {
        "a": SqueezeCause.BELOW_BUDGET,
        "b": SqueezeCause.OWN,
        "c": SqueezeCause.UNDER_PRESSURE,
    }
