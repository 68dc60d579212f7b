"""Virtual token counters (VTC) and the weighted shares, on injected values (no engine)."""

from __future__ import annotations

import math

import pytest

from workers.fair_share import (
    FairShare,
    Running,
    Scheduled,
    excess_over_share,
    served,
    tenant_weight,
    victim_order,
)


def test_tenant_and_weight_come_from_extra_args_and_bad_weights_are_refused():
    assert tenant_weight(None) == ("default", 1.0)
    assert tenant_weight({"tenant": "a", "tenant_weight": 3}) == ("a", 3.0)
    for bad in (0, -1.0, math.inf, math.nan, "2", True):
        with pytest.raises(ValueError, match="tenant_weight"):
            tenant_weight({"tenant": "a", "tenant_weight": bad})
    with pytest.raises(ValueError, match="prompt_cost"):
        FairShare(prompt_cost=-1.0)


def test_service_counts_prompt_then_output_tokens_at_their_costs():
    # 10 prompt tokens; computing the 10th samples the first output token
    assert served(4, 10, 1.0, 2.0) == 4
    assert served(10, 10, 1.0, 2.0) == 10 + 2 * 1
    assert served(13, 10, 1.0, 2.0) == 10 + 2 * 4
    assert served(13, 10, 0.5, 3.0) == 5 + 3 * 4


def test_settle_charges_each_position_once_divided_by_the_weight():
    fair = FairShare(prompt_cost=1.0, output_cost=2.0)
    fair.set_weight("b", 2.0)
    fair.settle([Scheduled("a1", "a", 10, 6), Scheduled("b1", "b", 10, 10)])
    assert fair.counter("a") == 6
    assert fair.counter("b") == (10 + 2) / 2
    fair.settle([Scheduled("a1", "a", 10, 10), Scheduled("b1", "b", 10, 11)])
    assert fair.counter("a") == 6 + 4 + 2
    assert fair.counter("b") == (10 + 2 + 2) / 2
    # preempted and recomputed from scratch: the positions were charged already
    fair.settle([Scheduled("a1", "a", 10, 8)])
    fair.settle([Scheduled("a1", "a", 10, 10)])
    assert fair.counter("a") == 12
    fair.forget("a1")
    fair.settle([Scheduled("a1", "a", 10, 2)])  # a new request reusing the id
    assert fair.counter("a") == 14


def test_admission_charges_provisionally_until_the_step_is_settled():
    fair = FairShare()
    fair.admit("a1", "a", 50)
    assert fair.counter("a") == 50
    fair.refund("a1")  # skipped: back in the queue
    assert fair.counter("a") == 0
    fair.admit("a1", "a", 50)
    fair.settle([Scheduled("a1", "a", 50, 20)])  # a chunk of 20 ran, not 50
    assert fair.counter("a") == 20 and not fair.provisional


def test_a_tenant_becoming_active_starts_at_the_smallest_waiting_counter():
    fair = FairShare()
    fair.enqueue("a")
    fair.enqueue("c")
    fair.counters.update({"a": 100.0, "c": 40.0, "b": 5.0})  # served since they arrived
    fair.enqueue("b")  # b idled: it starts at min(100, 40), not at its old 5
    assert fair.counter("b") == 40
    fair.enqueue("b")  # already waiting: no lift
    fair.counters["b"] = 45.0
    fair.enqueue("b")
    assert fair.counter("b") == 45
    fair.counters["d"] = 500.0
    fair.enqueue("d")  # a counter above the floor is kept (no credit for leaving)
    assert fair.counter("d") == 500


def test_with_nobody_waiting_a_new_tenant_starts_where_the_last_one_left():
    fair = FairShare()
    fair.enqueue("a")
    fair.counters["a"] = 30.0
    fair.dequeue("a")
    assert fair.last_left == "a" and "a" not in fair.waiting
    fair.counters["a"] = 45.0  # served after its queue emptied (its running requests)
    fair.enqueue("b")
    assert fair.counter("b") == 45  # lifted to a's counter now, not when it left


def test_a_refund_undoes_exactly_the_charge_whatever_the_weight_became():
    fair = FairShare()
    fair.set_weight("a", 2.0)
    for request_id in ("r1", "r2", "r3"):
        fair.admit(request_id, "a", 1000)  # 500 each at weight 2
    assert fair.counter("a") == 1500
    fair.set_weight("a", 1.0)  # a quota edit while they are in flight
    fair.refund("r1")
    fair.settle([])
    assert fair.counter("a") == 0 and min(fair.report([]).values()) >= 0


@pytest.mark.parametrize("weight", [1e-308, 0.0, -1.0, 1e4, float("nan")])
def test_a_weight_outside_the_control_planes_bounds_is_refused(weight):
    with pytest.raises(ValueError, match="tenant_weight"):
        tenant_weight({"tenant": "a", "tenant_weight": weight})


def test_a_request_put_back_does_not_lift_its_tenant():
    fair = FairShare()
    fair.counters.update({"a": 100.0, "b": 10.0})
    fair.enqueue("a")
    fair.enqueue("b", arrival=False)  # preempted: back in the queue at its own counter
    assert fair.counter("b") == 10


def test_backlogged_tenants_get_service_in_proportion_to_their_weights():
    """Two tenants always waiting, weights 1 and 3, equal requests: the engine admits
    from the smallest counter each time; over many admissions each one's service over its
    weight stays within one request's cost of the other's (VTC's bound)."""
    fair = FairShare(prompt_cost=1.0, output_cost=0.0)
    fair.set_weight("a", 1.0)
    fair.set_weight("b", 3.0)
    served_tokens = {"a": 0, "b": 0}
    for _ in range(400):
        tenant = min(("a", "b"), key=fair.counter)
        fair.settle([Scheduled(f"{tenant}{served_tokens[tenant]}", tenant, 10, 10)])
        served_tokens[tenant] += 10
        gap = abs(served_tokens["a"] / 1.0 - served_tokens["b"] / 3.0)
        assert gap <= 10
    assert served_tokens["b"] == pytest.approx(3 * served_tokens["a"], rel=0.02)


def test_prune_keeps_waiting_and_running_tenants():
    fair = FairShare()
    fair.counters.update({"idle": 1.0, "run": 1.0, "wait": 50.0, "rich": 90.0})
    fair.enqueue("wait")
    fair.prune({"run"})
    assert set(fair.counters) == {"run", "wait", "rich"}  # rich would not be lifted


def test_excess_over_share_weights_the_pool_between_present_tenants():
    # pool 100, weights 1 and 3: shares 25 and 75
    assert excess_over_share({"a": 60, "b": 30}, {"a": 1.0, "b": 3.0}, 100) == {"a": 35}
    # a waiting tenant (no blocks held) still takes its share
    assert excess_over_share({"a": 60}, {"a": 1.0, "w": 1.0}, 100) == {"a": 10}
    # one tenant: the whole pool is its share
    assert excess_over_share({"a": 100}, {"a": 1.0}, 100) == {}


def test_victim_order_puts_tenants_above_their_share_last():
    running = [Running("a1", "a"), Running("b1", "b"), Running("a2", "a"), Running("b2", "b")]
    assert victim_order(running, set(), by_priority=False) == ["a1", "b1", "a2", "b2"]
    assert victim_order(running, {"a"}, by_priority=False) == ["b1", "b2", "a1", "a2"]


def test_victim_order_under_priority_is_vllms_when_nobody_is_above_share():
    running = [
        Running("x", "a", priority=0, arrival_time=3.0),
        Running("y", "b", priority=1, arrival_time=1.0),
        Running("z", "a", priority=1, arrival_time=2.0),
    ]
    # vLLM preempts the largest (priority, arrival_time): z, then y, then x
    assert victim_order(running, set(), by_priority=True) == ["x", "y", "z"]
    # a tenant above its share is preempted first, whatever its priority
    assert victim_order(running, {"b"}, by_priority=True) == ["x", "z", "y"]
    assert victim_order(running, {"a"}, by_priority=True) == ["y", "x", "z"]


def test_a_low_priority_value_does_not_shield_a_tenant_above_its_share():
    flood = -(2**31) + 1
    running = [
        Running("flood-1", "flood", flood, 1.0),
        Running("flood-2", "flood", flood, 2.0),
        Running("light-1", "light", 0, 3.0),
    ]
    order = victim_order(running, above={"flood"}, by_priority=True)
    assert order[-1] == "flood-2"  # vLLM preempts from the end
    assert order == ["light-1", "flood-1", "flood-2"]
