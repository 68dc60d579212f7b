"""Weighted fairness in vLLM's ``Scheduler`` (``workers/fair_share.py``), driven from
``scheduler_hooks.py``:

- at construction its waiting queues become ``FairRequestQueue``s (``workers/fair_queue.py``);
- before each ``schedule``, when a tenant holds more than its weighted share of the pool,
  its running requests move behind the others (:func:`~workers.fair_share.victim_order`):
  vLLM preempts from the end of ``running``, so it takes from them first. Under the
  ``priority`` policy ``running`` is sorted the same way (above share first, then
  priority, then arrival) and vLLM's first-come, first-served preemption branch takes the
  last one for that step (``policy`` is swapped around the call; vLLM reads it nowhere else
  in ``schedule``): a tenant cannot shield itself from preemption with a priority value;
- after each ``schedule`` the counters are charged with what the step computes;
- the squeeze planner reads the same order to know which request vLLM would preempt.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from workers.fair_share import Running, Scheduled, excess_over_share, victim_order
from workers.scheduler_side import VTokenScheduler


def install_queues(scheduler: Any, state: VTokenScheduler) -> None:
    """Replace the (still empty) waiting queues with fair ones sharing the counters."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

    from workers.fair_queue import FairRequestQueue

    fair = state.fair
    if fair is None:
        return
    by_priority = scheduler.policy == SchedulingPolicy.PRIORITY
    for name in ("waiting", "kv_holding_waiting"):
        if getattr(scheduler, name):
            raise RuntimeError(f"vToken: the scheduler's {name} queue is not empty at start")

        def make_queue(policy: Any = scheduler.policy) -> Any:
            # The policy at start: ``before_schedule`` sets FCFS for a ``schedule`` call
            # (vLLM's preemption then takes the last entry), and a tenant's queue made
            # during that call must still order by priority.
            return create_request_queue(policy)

        setattr(scheduler, name, FairRequestQueue(fair, make_queue, by_priority))


def _by_priority(scheduler: Any) -> bool:
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    return bool(scheduler.policy == SchedulingPolicy.PRIORITY)


def tenants_above_share(state: VTokenScheduler) -> set[str]:
    """Tenants holding more than their weighted share of the pool (none with fairness
    off or fewer than two tenants present). O(running requests)."""
    if state.fair is None:
        return set()
    held: dict[str, int] = {}
    for record in state.requests.values():
        held[record.kv.tenant] = held.get(record.kv.tenant, 0) + record.paid_blocks
    weights = state.fair.present_weights(held)
    return set(excess_over_share(held, weights, state.pool.num_blocks))


def running_order(scheduler: Any, state: VTokenScheduler, above: set[str]) -> list[str]:
    """vLLM's running requests in the order its scheduler keeps them, the first it would
    preempt last (the squeeze planner's ``victim_order``)."""
    if not above and not _by_priority(scheduler):
        return [request.request_id for request in scheduler.running]
    entries = []
    for request in scheduler.running:
        record = state.requests.get(request.request_id)
        tenant = record.kv.tenant if record is not None else ""
        entries.append(Running(request.request_id, tenant, request.priority, request.arrival_time))
    return victim_order(entries, above, _by_priority(scheduler))


@contextmanager
def _fcfs_preemption(scheduler: Any) -> Iterator[None]:
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    policy = scheduler.policy
    scheduler.policy = SchedulingPolicy.FCFS
    try:
        yield
    finally:
        scheduler.policy = policy


def before_schedule(scheduler: Any, state: VTokenScheduler) -> Any:
    """Order ``running`` so that vLLM preempts from tenants above their share first; the
    context to run vLLM's ``schedule`` in. Nothing changes when no tenant is above it."""
    above = tenants_above_share(state)
    if not above:
        return nullcontext()
    position = {request.request_id: request for request in scheduler.running}
    scheduler.running[:] = [position[r] for r in running_order(scheduler, state, above)]
    return _fcfs_preemption(scheduler) if _by_priority(scheduler) else nullcontext()


def after_schedule(scheduler: Any, state: VTokenScheduler, output: Any) -> None:
    """Charge the tenants for what this step computes (``FairShare.settle``)."""
    if state.fair is None:
        return
    steps = []
    for request_id in output.num_scheduled_tokens:
        request, record = scheduler.requests[request_id], state.requests.get(request_id)
        if record is not None:
            num = (request.num_prompt_tokens, request.num_computed_tokens)
            steps.append(Scheduled(request_id, record.kv.tenant, *num))
    state.fair.settle(steps)
