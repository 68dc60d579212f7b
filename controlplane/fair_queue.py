"""The ingresses' fair queue: requests that must wait for room take a ticket in Redis.

A request that its tenant's limits (KV budget, concurrency) or the cluster's capacity
(``AdmissionConfig.cluster_kv_blocks``) cannot admit now joins its tenant's queue (at most
``max_queue_depth`` tickets, cluster-wide) and asks admission again every
``queue_poll_s`` with its ticket, until admitted, ``max_queue_wait_s`` has passed or its
client left. The state every ingress must agree on lives in Redis (:class:`KeySpace`'s
``queue_*`` keys), changed only inside Lua scripts on Redis's clock:

- **Order within a tenant**: first come, first served. Only a tenant's first ticket may be
  admitted; a request of a tenant with waiting tickets queues behind them.
- **Order between tenants** (virtual token counters, VTC, Sheng et al., OSDI 2024): each
  tenant's counter grows by the blocks of every request admitted from its queue divided by
  its weight. When the cluster is full, the tenant whose first ticket passed its own
  limits with the smallest counter is admitted next (ties by tenant id); no other request
  takes capacity before it, queued or not. A tenant that becomes active (its first ticket)
  starts at the smallest counter of the contending tenants (with none, at the smallest of
  the active ones but not below the virtual time, the counter the latest ticket was
  admitted at, which never moves back): idling earns no credit, and a tenant arriving while
  another floods the queue waits for at most one of its requests.
- **Within its share, no wait**: a request whose tenant, with it, holds no more than its
  weighted share of the capacity (capacity x its weight / the weights of the tenants
  present: holding reservations, or queued) is admitted even when the cluster is full,
  as long as the cluster's reservation total stays within twice the capacity. Only
  requests over their tenant's share wait; the room is what the tenants above their
  shares hold (the engines' fair squeeze and preemption take it back from them), and
  none of theirs is admitted again until the total is back under the capacity. The bound
  keeps tenants arriving one by one from growing the total without limit (each new
  share would otherwise add capacity / k); a tenant within its share that meets it waits
  for its turn, which its small counter gives it first. The share is computed only when
  the cluster has no room.
- **Liveness**: a ticket's lease is renewed by each poll; a ticket whose ingress died lapses
  after ``queue_ticket_ttl_s`` and is dropped by the next script touching its tenant, and a
  tenant whose tickets all lapsed leaves the contention for the cluster. A ticket that
  passes its tenant's limits but not the cluster's contends; one its own limits hold back
  does not, so a tenant over its budget never holds up the others. A tenant whose ticket
  was admitted keeps contending at its new counter, unless its own limits (concurrency,
  budget, prompt-token rate, judged for another request of the same size) will hold its
  next one back: then it leaves the contention until its next ticket polls and passes them.
  A request that could never be admitted (over its tenant's budget or the cluster's
  capacity, ``n`` over its concurrency limit) is rejected before it queues.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from controlplane import fair_queue_scripts as scripts
from controlplane.admission import AdmissionConfig
from controlplane.keys import KeySpace, queue_keys
from controlplane.models import TenantQuota

QUEUEABLE_REASONS = frozenset({"kv_budget", "max_concurrent_requests", "cluster_full", "queued"})
"""Throttles a request may wait out in the queue (the prompt-token rate names its own
wait, so it is a 429 at once, as are requests that can never fit)."""


@dataclass(frozen=True, slots=True)
class Enqueued:
    """``queued``: whether the ticket joined; ``depth``: the tenant's tickets after it
    (before it, when refused); ``at_s``: Redis's clock then."""

    queued: bool
    depth: int
    at_s: float


@dataclass(frozen=True, slots=True)
class TenantQueue:
    """One tenant's waiting requests, cluster-wide: live tickets, how long the oldest has
    waited, and its virtual counter."""

    tenant_id: str
    depth: int
    oldest_wait_s: float
    counter: float


class FairQueue:
    """Tickets of requests waiting for admission (the contract: module docstring). The
    admission itself is :meth:`controlplane.admission.Admission.admit` with the ticket."""

    def __init__(
        self, redis: aioredis.Redis, config: AdmissionConfig, keys: KeySpace | None = None
    ) -> None:
        self.config = config
        self.keys = keys if keys is not None else KeySpace()
        self._redis = redis
        self._enqueue = redis.register_script(scripts.ENQUEUE)
        self._leave = redis.register_script(scripts.LEAVE)

    def _keys(self, tenant_id: str) -> list[str]:
        return queue_keys(self.keys, tenant_id)

    async def enqueue(self, quota: TenantQuota, ticket: str) -> Enqueued:
        """Add ``ticket`` at the end of the tenant's queue, unless it holds
        ``max_queue_depth`` live tickets already."""
        if not ticket:
            raise ValueError("ticket must be non-empty")
        tenant_id = quota.tenant_id
        queued, depth, now_ms = await self._enqueue(
            keys=[*self._keys(tenant_id), self.keys.queue_counters, self.keys.queue_virtual_time],
            args=[
                tenant_id,
                ticket,
                quota.max_queue_depth,
                int(self.config.queue_ticket_ttl_s * 1000),
            ],
        )
        return Enqueued(bool(queued), int(depth), int(now_ms) / 1000)

    async def leave(self, tenant_id: str, ticket: str) -> bool:
        """Take ``ticket`` out of the queue (its client left, or it waited too long);
        idempotent, True if it was queued."""
        removed = await self._leave(keys=self._keys(tenant_id), args=[tenant_id, ticket])
        return bool(removed)

    async def queues(self) -> dict[str, TenantQueue]:
        """Every tenant with live tickets, by tenant id (read only; lapsed tickets not
        counted): what ``/admin/status`` and ``vtoken status`` show."""
        keys = self.keys
        seconds, microseconds = await self._redis.time()
        now_ms = seconds * 1000 + microseconds // 1000
        tenants: list[str] = await self._redis.zrangebyscore(  # type: ignore[assignment]
            keys.queue_tenant_leases, f"({now_ms}", "+inf"
        )
        if not tenants:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for tenant_id in tenants:
                pipe.zrangebyscore(keys.queue_leases(tenant_id), f"({now_ms}", "+inf")
                pipe.zrange(keys.queue_tickets(tenant_id), 0, -1, withscores=True)
                pipe.zscore(keys.queue_active, tenant_id)
            replies = await pipe.execute()
        found = {}
        for index, tenant_id in enumerate(tenants):
            live, joined, counter = replies[3 * index : 3 * index + 3]
            alive = set(live)
            starts = [score for ticket, score in joined if ticket in alive]
            if starts:
                oldest_s = max(0.0, (now_ms - min(starts)) / 1000)
                found[tenant_id] = TenantQueue(tenant_id, len(starts), oldest_s, counter or 0.0)
        return found

    async def counter(self, tenant_id: str) -> float:
        """The tenant's virtual counter (0 before its first queued admission)."""
        value = await self._redis.hget(self.keys.queue_counters, tenant_id)
        return float(value or 0)

    async def check_invariants(self) -> None:
        """Every contending tenant is active, every active one has a ticket, and each
        ticket has a lease (tests call this)."""
        keys = self.keys
        active: set[str] = set(await self._redis.zrange(keys.queue_active, 0, -1))  # type: ignore[arg-type]
        contending = set(await self._redis.zrange(keys.queue_contending, 0, -1))
        assert contending <= active, (contending, active)
        for tenant_id in active:
            tickets = set(await self._redis.zrange(keys.queue_tickets(tenant_id), 0, -1))
            leases = set(await self._redis.zrange(keys.queue_leases(tenant_id), 0, -1))
            assert tickets, tenant_id
            assert tickets == leases, (tenant_id, tickets, leases)
