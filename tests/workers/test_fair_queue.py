"""The fair waiting queue on stand-in requests (vLLM's queue classes, no engine)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

from workers.fair_queue import FairRequestQueue
from workers.fair_share import FairShare

_arrivals = itertools.count()


@dataclass(eq=False)
class Req:
    """What the queue reads of a vLLM ``Request``."""

    request_id: str
    tenant: str | None = None
    weight: float | None = None
    num_tokens: int = 10
    num_computed_tokens: int = 0
    priority: int = 0
    arrival_time: float = field(default_factory=lambda: float(next(_arrivals)))

    @property
    def sampling_params(self) -> Any:
        extra: dict[str, Any] = {}
        if self.tenant is not None:
            extra["tenant"] = self.tenant
        if self.weight is not None:
            extra["tenant_weight"] = self.weight
        return SimpleNamespace(extra_args=extra)

    def __lt__(self, other: Req) -> bool:  # vLLM's priority heap order
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)


def queue(policy: SchedulingPolicy = SchedulingPolicy.FCFS) -> FairRequestQueue:
    return FairRequestQueue(
        FairShare(), lambda: create_request_queue(policy), policy == SchedulingPolicy.PRIORITY
    )


def drain(q: FairRequestQueue, settle: bool = True) -> list[str]:
    """Pop everything, each pop its own step (settled: charged what it computes)."""
    from workers.fair_share import Scheduled

    order = []
    while q:
        request = q.pop_request()
        order.append(request.request_id)
        if settle:
            tenant = request.tenant or "default"
            step = Scheduled(request.request_id, tenant, request.num_tokens, request.num_tokens)
            q.fair.settle([step])
    return order


def test_one_tenant_or_none_is_first_come_first_served():
    for tenant in (None, "a"):
        q = queue()
        requests = [Req(f"r{i}", tenant) for i in range(5)]
        for request in requests:
            q.add_request(request)
        first = q.pop_request()
        q.prepend_request(first)  # preempted or skipped: back at the front
        assert q.peek_request() is first
        assert [r.request_id for r in q] == [f"r{i}" for i in range(5)]
        assert drain(q) == [f"r{i}" for i in range(5)]
        assert len(q) == 0 and not q


def test_a_tenant_arriving_behind_a_flood_is_served_before_the_flood_drains():
    q = queue()
    for i in range(6):
        q.add_request(Req(f"a{i}", "a"))
    for i in range(2):
        q.add_request(Req(f"b{i}", "b"))
    # FCFS would serve a0..a5 first; equal requests alternate, a first on arrival
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_within_one_schedule_pops_alternate_before_anything_is_settled():
    q = queue()
    for i in range(3):
        q.add_request(Req(f"a{i}", "a"))
    for i in range(3):
        q.add_request(Req(f"b{i}", "b"))
    assert drain(q, settle=False) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_weights_share_admissions():
    q = queue()
    for i in range(8):
        q.add_request(Req(f"a{i}", "a", weight=1.0))
    for i in range(8):
        q.add_request(Req(f"b{i}", "b", weight=3.0))
    order = drain(q)[:8]
    assert sum(r.startswith("b") for r in order) == 6  # three of b's per one of a's


def test_a_skipped_request_is_refunded_and_keeps_its_place():
    q = queue()
    a0, b0 = Req("a0", "a"), Req("b0", "b")
    q.add_request(a0)
    q.add_request(b0)
    skipped = q.pop_request()
    assert skipped is a0 and q.fair.counter("a") == 10
    q.prepend_requests([skipped])
    assert q.fair.counter("a") == 0 and q.peek_request() is a0 and len(q) == 2


def test_removed_requests_leave_their_tenant_inactive():
    q = queue()
    requests = [Req("a0", "a"), Req("a1", "a"), Req("b0", "b")]
    for request in requests:
        q.add_request(request)
    q.remove_requests(requests[:2])
    assert len(q) == 1 and "a" not in q.fair.waiting and q.peek_request().request_id == "b0"
    q.remove_request(requests[2])
    assert not q and not q.fair.waiting


def test_priority_orders_only_within_a_tenant_and_counters_order_the_tenants():
    q = queue(SchedulingPolicy.PRIORITY)
    q.add_request(Req("a-low", "a", priority=1))
    q.add_request(Req("a-high", "a", priority=0))
    q.add_request(Req("b-low", "b", priority=1))
    q.fair.counters["a"] = 1000.0  # a was served much more: b first, whatever a's priority
    assert drain(q) == ["b-low", "a-high", "a-low"]


def test_a_flooding_tenant_cannot_jump_the_weights_with_a_low_priority():
    q = queue(SchedulingPolicy.PRIORITY)
    for i in range(3):
        q.add_request(Req(f"flood-{i}", "flood", priority=-(2**31) + 1))
    q.add_request(Req("light-0", "light", priority=0))
    q.fair.counters["flood"] = 50.0  # flood was served more than light
    assert q.peek_request().request_id == "light-0"
    assert drain(q)[0] == "light-0"


def test_a_tenants_queue_made_while_the_policy_is_swapped_still_orders_by_priority():
    """``before_schedule`` sets the scheduler's policy to FCFS for one ``schedule`` call;
    a request put back during it (preempted, skipped) may create its tenant's queue then:
    that queue must still be a priority queue."""
    from workers.vllm_patches.fair_hooks import install_queues

    scheduler = SimpleNamespace(policy=SchedulingPolicy.PRIORITY, waiting=[], kv_holding_waiting=[])
    install_queues(scheduler, SimpleNamespace(fair=FairShare()))
    scheduler.policy = SchedulingPolicy.FCFS  # as inside the swapped schedule call
    scheduler.waiting.prepend_request(Req("a-late", "a", priority=5))
    scheduler.policy = SchedulingPolicy.PRIORITY
    scheduler.waiting.add_request(Req("a-urgent", "a", priority=0))
    assert drain(scheduler.waiting) == ["a-urgent", "a-late"]
