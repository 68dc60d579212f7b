"""The fair queue on a real redis-server: order within and between tenants, weights,
activation, bounds, leaving, lapsed tickets, and the cluster's reservation total."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from controlplane.admission import Admission, AdmissionConfig, AdmissionOutcome, Reservation
from controlplane.fair_queue import FairQueue
from controlplane.keys import KeySpace
from controlplane.models import TenantQuota
from controlplane.store import RedisStore
from controlplane.tenants import remove_tenant
from tests.controlplane.builders import quota

PROMPT, MAX_TOKENS = 32, 16  # one request: the unit of the cluster's capacity below


def one_request_blocks(admission: Admission) -> int:
    return admission.bounds(quota("any"), PROMPT, MAX_TOKENS, 1).peak


async def make(
    redis: aioredis.Redis, keys: KeySpace, requests_fit: int = 1, ttl_s: float = 60.0
) -> tuple[Admission, FairQueue]:
    """Admission and queue on a cluster that holds ``requests_fit`` requests at once."""
    unit = one_request_blocks(Admission(redis, AdmissionConfig(block_size=16), keys))
    config = AdmissionConfig(
        block_size=16,
        cluster_kv_blocks=unit * requests_fit,
        queue_poll_s=0.05,
        queue_ticket_ttl_s=ttl_s,
    )
    return Admission(redis, config, keys), FairQueue(redis, config, keys)


async def ask(admission: Admission, tenant: TenantQuota, ticket: str) -> AdmissionOutcome | str:
    """``admitted``, or the reason it waits."""
    decision = await admission.admit(tenant, ticket, PROMPT, MAX_TOKENS, ticket=ticket)
    return "admitted" if decision.admitted else decision.reason


async def release(admission: Admission, tenant: TenantQuota, request_id: str) -> None:
    blocks = one_request_blocks(admission)
    await admission.release(Reservation(tenant.tenant_id, request_id, blocks, blocks))


async def test_weights_one_to_two_get_one_to_two_of_the_releases(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Two backlogged tenants, weights 1 and 2, a cluster holding one request: over 30
    releases the heavier one is admitted twice as often, whichever polls first."""
    admission, queue = await make(redis, keys)
    light = quota("light", 10_000, weight=1.0, max_queue_depth=30)
    heavy = quota("heavy", 10_000, weight=2.0, max_queue_depth=30)
    for tenant in (light, heavy):
        await store.put_quota(tenant)
    holder = quota("holder", 10_000)
    await store.put_quota(holder)
    assert (await admission.admit(holder, "held", PROMPT, MAX_TOKENS)).admitted
    tickets = {t.tenant_id: [f"{t.tenant_id}-{i}" for i in range(30)] for t in (light, heavy)}
    for tenant in (light, heavy):
        for ticket in tickets[tenant.tenant_id]:
            assert (await queue.enqueue(tenant, ticket)).queued
    await release(admission, holder, "held")
    served: list[str] = []
    for round_number in range(30):
        order = (light, heavy) if round_number % 2 else (heavy, light)
        admitted = []
        for tenant in order:  # every head polls; the smallest counter gets the room
            head = tickets[tenant.tenant_id][0]
            if await ask(admission, tenant, head) == "admitted":
                admitted.append((tenant, tickets[tenant.tenant_id].pop(0)))
        assert len(admitted) == 1, (round_number, admitted)
        served.append(admitted[0][0].tenant_id)
        await release(admission, *admitted[0])
        await queue.check_invariants()
    assert abs(served.count("heavy") - 20) <= 1, served
    assert abs(served.count("light") - 10) <= 1, served
    assert await queue.counter("heavy") == pytest.approx(await queue.counter("light"), abs=4)


async def test_the_smallest_counter_goes_first_and_a_newcomer_starts_at_the_smallest(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A tenant flooding the queue has been served; a tenant that becomes active starts at
    the smallest active counter (not at 0, its idle credit), so it is admitted after at
    most one more of the flood's requests, and is not ahead of the flood for long."""
    admission, queue = await make(redis, keys)
    flood, late = quota("a-flood", 10_000), quota("b-late", 10_000)
    for tenant in (flood, late):
        await store.put_quota(tenant)
    flood_tickets = [f"flood-{i}" for i in range(8)]
    for ticket in flood_tickets:
        await queue.enqueue(flood, ticket)
    for ticket in flood_tickets[:4]:  # four admitted and finished while alone
        assert await ask(admission, flood, ticket) == "admitted"
        await release(admission, flood, ticket)
    flood_counter = await queue.counter("a-flood")
    assert flood_counter == 4 * one_request_blocks(admission)
    await queue.enqueue(late, "late-0")
    assert await queue.counter("b-late") == flood_counter  # lifted, not 0
    order: list[str] = []
    flood_left = flood_tickets[4:]
    for _ in range(3):
        for tenant in (late, flood):  # the late one polls first: it must still wait its turn
            head = "late-0" if tenant is late else flood_left[0]
            if head in order:
                continue
            if await ask(admission, tenant, head) == "admitted":
                order.append(head)
                if tenant is flood:
                    flood_left.pop(0)
                await release(admission, tenant, head)
                break
    # A tie at the same counter goes by tenant id: one flood request, then the late one.
    assert order == ["flood-4", "late-0", "flood-5"], order


async def test_a_ticket_waits_behind_its_tenants_earlier_tickets_and_fresh_requests_too(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission, queue = await make(redis, keys, requests_fit=4)
    tenant = quota("acme", one_request_blocks(admission))  # its budget holds one request
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "running", PROMPT, MAX_TOKENS)).admitted
    fresh = await admission.admit(tenant, "fresh", PROMPT, MAX_TOKENS)
    assert fresh.reason == "kv_budget"
    await queue.enqueue(tenant, "first")
    await queue.enqueue(tenant, "second")
    behind = await admission.admit(tenant, "second", PROMPT, MAX_TOKENS, ticket="second")
    assert (behind.reason, behind.queue_position) == ("queued", 1)  # one ticket ahead
    assert await ask(admission, tenant, "first") == "kv_budget"  # its own budget holds it
    assert await redis.zcard(keys.queue_contending) == 0  # and it holds up no other tenant
    await release(admission, tenant, "running")
    again = await admission.admit(tenant, "fresh", PROMPT, MAX_TOKENS)
    assert again.reason == "queued"  # room now, but the tickets came first
    assert await ask(admission, tenant, "second") == "queued"
    assert await ask(admission, tenant, "first") == "admitted"
    await release(admission, tenant, "first")
    assert await ask(admission, tenant, "second") == "admitted"
    await release(admission, tenant, "second")
    assert await queue.queues() == {}
    await admission.check_invariants("acme")


async def test_a_fresh_request_does_not_take_the_room_a_contending_tenant_waits_for(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission, queue = await make(redis, keys)
    waiting, newcomer = quota("waiting", 10_000), quota("newcomer", 10_000)
    for tenant in (waiting, newcomer):
        await store.put_quota(tenant)
    assert (await admission.admit(newcomer, "running", PROMPT, MAX_TOKENS)).admitted
    await queue.enqueue(waiting, "w-0")
    assert await ask(admission, waiting, "w-0") == "cluster_full"
    await release(admission, newcomer, "running")
    fresh = await admission.admit(newcomer, "fresh", PROMPT, MAX_TOKENS)
    assert fresh.reason == "cluster_full"  # room, but it is the waiting tenant's turn
    assert await ask(admission, waiting, "w-0") == "admitted"
    await release(admission, waiting, "w-0")


async def test_depth_bounds_the_queue_and_leaving_frees_the_place(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission, queue = await make(redis, keys)
    tenant = quota("acme", 10_000, max_queue_depth=2)
    other = quota("other", 10_000)
    for t in (tenant, other):
        await store.put_quota(t)
    assert (await queue.enqueue(tenant, "t-0")).queued
    assert (await queue.enqueue(tenant, "t-1")).depth == 2
    refused = await queue.enqueue(tenant, "t-2")
    assert (refused.queued, refused.depth) == (False, 2)
    assert (await queue.queues())["acme"].depth == 2
    assert await queue.leave("acme", "t-0")
    assert not await queue.leave("acme", "t-0")  # idempotent
    assert (await queue.enqueue(tenant, "t-2")).queued
    await queue.enqueue(other, "o-0")
    assert await ask(admission, other, "o-0") == "admitted"  # the only contender
    await release(admission, other, "o-0")
    for ticket in ("t-1", "t-2"):
        await queue.leave("acme", ticket)
    assert await queue.queues() == {}
    await queue.check_invariants()


async def test_a_dead_ingresses_tickets_lapse_and_stop_holding_up_others(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """The contending tenant's ingress stops polling: after the ticket lease its tickets
    are gone and the next tenant gets the room."""
    admission, queue = await make(redis, keys, ttl_s=0.3)
    dead, alive = quota("a-dead", 10_000), quota("b-alive", 10_000)
    for tenant in (dead, alive):
        await store.put_quota(tenant)
    assert (await admission.admit(alive, "running", PROMPT, MAX_TOKENS)).admitted
    await queue.enqueue(dead, "dead-0")
    await queue.enqueue(dead, "dead-1")
    assert await ask(admission, dead, "dead-0") == "cluster_full"  # it contends, first
    await queue.enqueue(alive, "alive-0")
    await release(admission, alive, "running")
    assert await ask(admission, alive, "alive-0") == "cluster_full"  # a-dead's turn
    for _ in range(4):  # alive keeps polling (its lease holds); a-dead's lapses
        await asyncio.sleep(0.1)
        outcome = await ask(admission, alive, "alive-0")
    assert outcome == "admitted"
    assert set(await queue.queues()) == set()
    assert await ask(admission, dead, "dead-1") == "ticket_lost"
    await release(admission, alive, "alive-0")
    await queue.check_invariants()


async def test_the_cluster_total_follows_every_reservation_change(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission, _ = await make(redis, keys, requests_fit=10)
    tenants = [quota("one", 1000), quota("two", 1000)]
    for tenant in tenants:
        await store.put_quota(tenant)

    async def cluster_total() -> int:
        return int(await redis.get(keys.cluster_reservation_total) or 0)

    held = []
    for tenant in tenants:
        for i in range(2):
            decision = await admission.admit(tenant, f"{tenant.tenant_id}-{i}", 64, 16)
            assert decision.reservation is not None
            held.append(decision.reservation)
    totals = [await admission.reserved_blocks(t.tenant_id) for t in tenants]
    assert await cluster_total() == sum(totals)
    settled = await admission.settle(held[0])
    assert await cluster_total() == sum(totals) - (held[0].blocks - settled.blocks)
    await admission.release(settled)
    totals = [await admission.reserved_blocks(t.tenant_id) for t in tenants]
    assert await cluster_total() == sum(totals)
    await remove_tenant(redis, keys, "two")
    assert await cluster_total() == await admission.reserved_blocks("one")
    await admission.release(held[1])
    assert await cluster_total() == 0
