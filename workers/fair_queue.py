"""vLLM's waiting queue in weighted-fair order (``workers/fair_share.py``).

One sub-queue per tenant, each of vLLM's own kind (first come, first served, or its
``priority`` heap): within a tenant vLLM's order is kept. The head is the head of the
tenant with the smallest virtual counter; ties go to the earlier arrival, so with one
tenant (or none named) the queue is vLLM's own. Under the ``priority`` policy a request's
priority orders it only within its own tenant's sub-queue: the tenants are ordered by
their counters (their weights) whatever priority their requests carry, so no tenant can
jump ahead of the operator's weights by sending a low priority value. Finding the head
reads every tenant with a waiting request once: O(tenants), never O(requests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from workers.fair_share import FairShare, tenant_weight


def request_tenant(request: Request) -> tuple[str, float]:
    """A vLLM request's tenant and weight (checked when the request came in)."""
    params = request.sampling_params
    return tenant_weight(params.extra_args if params is not None else None)


class FairRequestQueue(RequestQueue):
    """A ``RequestQueue`` ordered by the tenants' virtual counters (``fair``, shared by an
    engine's queues); ``make_queue`` builds one tenant's sub-queue (vLLM's kind)."""

    def __init__(
        self, fair: FairShare, make_queue: Callable[[], RequestQueue], by_priority: bool
    ) -> None:
        self.fair = fair
        self.make_queue = make_queue
        self.by_priority = by_priority
        self.queues: dict[str, RequestQueue] = {}
        self.size = 0

    def _queue(self, tenant: str) -> RequestQueue:
        queue = self.queues.get(tenant)
        if queue is None:
            queue = self.queues[tenant] = self.make_queue()
        return queue

    def _key(self, tenant: str) -> tuple[float, float]:
        # priority is not part of the key: it orders only within the tenant's sub-queue
        head = self.queues[tenant].peek_request()
        return (self.fair.counter(tenant), head.arrival_time)

    def _head_tenant(self) -> str:
        if not self.queues:
            raise IndexError("peek from an empty queue")
        return min(self.queues, key=self._key)

    def _taken(self, tenant: str) -> None:
        if not self.queues[tenant]:
            del self.queues[tenant]
        self.size -= 1
        self.fair.dequeue(tenant)

    def _put(self, request: Request, arrival: bool) -> str:
        tenant, weight = request_tenant(request)
        self.fair.set_weight(tenant, weight)
        self.fair.enqueue(tenant, arrival=arrival)
        self.size += 1
        return tenant

    def add_request(self, request: Request) -> None:
        self._queue(self._put(request, arrival=True)).add_request(request)

    def pop_request(self) -> Request:
        tenant = self._head_tenant()
        request = self.queues[tenant].pop_request()
        self._taken(tenant)
        self.fair.admit(
            request.request_id, tenant, request.num_tokens - request.num_computed_tokens
        )
        return request

    def peek_request(self) -> Request:
        return self.queues[self._head_tenant()].peek_request()

    def prepend_request(self, request: Request) -> None:
        """Back at the front of its tenant's queue (preempted, or skipped this step)."""
        self.fair.refund(request.request_id)
        self._queue(self._put(request, arrival=False)).prepend_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Each in turn at the front of its tenant's queue (vLLM's ``extendleft``)."""
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        tenant, _ = request_tenant(request)
        self.queues[tenant].remove_request(request)
        self._taken(tenant)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        by_tenant: dict[str, list[Request]] = {}
        for request in requests:
            tenant, _ = request_tenant(request)
            if tenant in self.queues:
                by_tenant.setdefault(tenant, []).append(request)
        for tenant, mine in by_tenant.items():
            queue = self.queues[tenant]
            before = len(queue)
            queue.remove_requests(mine)
            for _ in range(before - len(queue)):
                self.size -= 1
                self.fair.dequeue(tenant)
            if not queue:
                del self.queues[tenant]

    def __bool__(self) -> bool:
        return self.size > 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Request]:
        """Tenant by tenant, in head order (what a pop would take first, without charges)."""
        for tenant in sorted(self.queues, key=self._key):
            yield from self.queues[tenant]
