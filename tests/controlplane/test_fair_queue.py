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


@pytest.mark.parametrize("polls_between_releases", [True, False])
async def test_weights_one_to_two_get_one_to_two_of_the_releases(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, polls_between_releases: bool
) -> None:
    """Two backlogged tenants, weights 1 and 2, a cluster holding one request: over 30
    releases the heavier one is admitted twice as often, whichever polls first, and
    whether or not the heads poll while a request runs (room freed faster than tickets
    poll must not flatten the weights)."""
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
        for tenant in order if polls_between_releases else ():  # every head polls again
            if tickets[tenant.tenant_id]:
                assert await ask(admission, tenant, tickets[tenant.tenant_id][0]) == "cluster_full"
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
    for ticket, following in zip(flood_tickets[:4], flood_tickets[1:5], strict=True):
        assert await ask(admission, flood, ticket) == "admitted"  # four served while alone,
        assert await ask(admission, flood, following) == "cluster_full"  # the next polling
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


async def test_a_request_larger_than_the_cluster_is_rejected_and_holds_up_nobody(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A peak above ``cluster_kv_blocks`` (within its tenant's budget) could never be
    admitted: it is rejected at once, even with a ticket, and never contends, so another
    tenant's request is admitted on the empty cluster."""
    admission, queue = await make(redis, keys, requests_fit=2)
    capacity = admission.config.cluster_kv_blocks
    assert capacity is not None
    big, small = quota("a-big", 10_000), quota("b-small", 10_000)
    for tenant in (big, small):
        await store.put_quota(tenant)
    prompt_at_capacity = capacity * 16 - MAX_TOKENS
    assert admission.bounds(big, prompt_at_capacity, MAX_TOKENS, 1).peak == capacity
    huge = await admission.admit(big, "huge", prompt_at_capacity + 16, MAX_TOKENS)
    assert (huge.outcome, huge.reason) == (AdmissionOutcome.REJECTED, "exceeds_cluster_capacity")
    assert (await queue.enqueue(big, "huge")).queued  # say, taken before a smaller capacity
    queued = await admission.admit(big, "huge", prompt_at_capacity + 16, MAX_TOKENS, ticket="huge")
    assert queued.reason == "exceeds_cluster_capacity"
    assert await redis.zcard(keys.queue_contending) == 0
    assert (await admission.admit(small, "s-0", PROMPT, MAX_TOKENS)).admitted
    await release(admission, small, "s-0")
    assert await queue.leave("a-big", "huge")
    at_capacity = await admission.admit(big, "whole", prompt_at_capacity, MAX_TOKENS)
    assert at_capacity.reservation is not None  # exactly the capacity fits
    await admission.release(at_capacity.reservation)
    await queue.check_invariants()


async def test_n_above_the_concurrency_limit_is_rejected_even_behind_queued_tickets(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission, queue = await make(redis, keys, requests_fit=4)
    tenant = quota("acme", 10_000, max_concurrent_requests=1)
    await store.put_quota(tenant)
    await queue.enqueue(tenant, "waiting")
    never = await admission.admit(tenant, "never", PROMPT, MAX_TOKENS, n=2)
    assert (never.outcome, never.reason) == (
        AdmissionOutcome.REJECTED,
        "exceeds_max_concurrent_requests",
    )
    assert await queue.leave("acme", "waiting")


async def test_a_tenant_served_leaves_the_contention_until_its_next_ticket_passes_its_limits(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """``a-limited`` (one request at a time) has the smallest counter; once its first
    ticket is admitted its second one cannot run, so it must not hold the free room from
    ``b-other`` until that ticket polls."""
    admission, queue = await make(redis, keys, requests_fit=4)
    limited = quota("a-limited", 10_000, max_concurrent_requests=1)
    other = quota("b-other", 10_000)
    for tenant in (limited, other):
        await store.put_quota(tenant)
    for ticket in ("l-0", "l-1"):
        await queue.enqueue(limited, ticket)
    await queue.enqueue(other, "o-0")
    assert await ask(admission, other, "o-0") == "admitted"  # b-other's counter is above 0
    await release(admission, other, "o-0")
    await queue.enqueue(other, "o-1")
    assert await ask(admission, limited, "l-0") == "admitted"
    assert await redis.zrange(keys.queue_contending, 0, -1) == []
    assert await ask(admission, other, "o-1") == "admitted"  # three requests' room is free
    assert await ask(admission, limited, "l-1") == "max_concurrent_requests"
    for tenant, ticket in ((limited, "l-0"), (other, "o-1")):
        await release(admission, tenant, ticket)
    assert await ask(admission, limited, "l-1") == "admitted"
    await release(admission, limited, "l-1")
    assert await queue.queues() == {}
    await queue.check_invariants()


async def test_a_newcomer_starts_at_the_contenders_counter_not_a_held_back_tenants(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """``stuck`` waits active at counter 0, held back by its own budget, while ``a`` and
    ``b`` take turns: a tenant arriving then starts at the smallest counter of the
    contenders (``stuck``'s would let it jump ahead of them), and the virtual time never
    moves back when ``stuck`` is served at its old counter."""
    admission, queue = await make(redis, keys, requests_fit=2)
    stuck = quota("stuck", one_request_blocks(admission))  # its budget holds one request
    a, b, late = quota("a", 10_000), quota("b", 10_000), quota("late", 10_000)
    for tenant in (stuck, a, b, late):
        await store.put_quota(tenant)
    assert (await admission.admit(stuck, "stuck-running", PROMPT, MAX_TOKENS)).admitted
    await queue.enqueue(stuck, "stuck-0")
    assert await ask(admission, stuck, "stuck-0") == "kv_budget"
    for i in range(10):  # the cluster holds one request besides stuck's
        for tenant in (a, b):
            ticket = f"{tenant.tenant_id}-{i}"
            await queue.enqueue(tenant, ticket)
            assert await ask(admission, tenant, ticket) == "admitted"
            await release(admission, tenant, ticket)
    assert (await admission.admit(a, "a-running", PROMPT, MAX_TOKENS)).admitted  # now full
    for tenant in (a, b):
        await queue.enqueue(tenant, f"{tenant.tenant_id}-keep")
        assert await ask(admission, tenant, f"{tenant.tenant_id}-keep") == "cluster_full"
    floor = min(await queue.counter("a"), await queue.counter("b"))
    assert floor >= 9 * one_request_blocks(admission)
    await queue.enqueue(late, "late-0")
    assert await queue.counter("late") == floor
    virtual_time = float(await redis.get(keys.queue_virtual_time))
    assert virtual_time > 0
    for tenant, request_id in ((stuck, "stuck-running"), (a, "a-running")):
        await release(admission, tenant, request_id)
    assert await ask(admission, stuck, "stuck-0") == "admitted"  # at its old counter, 0
    assert float(await redis.get(keys.queue_virtual_time)) == virtual_time
    await release(admission, stuck, "stuck-0")
    for tenant, ticket in ((a, "a-keep"), (b, "b-keep"), (late, "late-0")):
        await queue.leave(tenant.tenant_id, ticket)
    await queue.check_invariants()


async def test_the_counter_grows_at_the_stored_weight_not_the_ingresss_copy(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission, queue = await make(redis, keys)
    cached = quota("acme", 10_000, weight=1.0)
    await store.put_quota(quota("acme", 10_000, weight=4.0))  # an admin changed it since
    await queue.enqueue(cached, "t-0")
    assert await ask(admission, cached, "t-0") == "admitted"
    assert await queue.counter("acme") == one_request_blocks(admission) / 4
    await release(admission, cached, "t-0")


async def test_a_served_tenant_its_prompt_rate_will_hold_leaves_the_contention(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """``a-rated``'s token bucket holds one prompt: once served it cannot take the next
    room for about a second, so it must not keep the head from ``b-other``."""
    admission, queue = await make(redis, keys, requests_fit=1)
    rated = quota("a-rated", 10_000, prompt_tokens_per_s=PROMPT)
    other = quota("b-other", 10_000)
    for tenant in (rated, other):
        await store.put_quota(tenant)
    for i in range(2):  # b-other's counter: two requests ahead of a-rated's
        await queue.enqueue(other, f"o-{i}")
        assert await ask(admission, other, f"o-{i}") == "admitted"
        await release(admission, other, f"o-{i}")
    for ticket in ("a-0", "a-1"):
        await queue.enqueue(rated, ticket)
    await queue.enqueue(other, "o-x")
    assert await ask(admission, rated, "a-0") == "admitted"  # its bucket is now empty
    await release(admission, rated, "a-0")
    assert await ask(admission, other, "o-x") == "admitted"
    await release(admission, other, "o-x")
    assert await queue.leave("a-rated", "a-1")


async def test_a_tenant_within_its_weighted_share_does_not_wait_for_a_full_cluster(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A flood holds the whole cluster (four requests) and queues more; a light tenant of
    the same weight is present with it, so its share is half the cluster: its first two
    requests are admitted at once, over the capacity, its third waits. The flood, above
    its share, is admitted again only once the total is back under the capacity, in
    turn; a tenant alone (nobody else present) is held to the capacity as before."""
    admission, queue = await make(redis, keys, requests_fit=4)
    unit = one_request_blocks(admission)
    flood, light = quota("flood", 10_000), quota("light", 10_000)
    for tenant in (flood, light):
        await store.put_quota(tenant)
    for index in range(4):
        assert (await admission.admit(flood, f"f-run-{index}", PROMPT, MAX_TOKENS)).admitted
    alone = await admission.admit(flood, "f-more", PROMPT, MAX_TOKENS)
    assert alone.reason == "cluster_full"  # alone, its share is the whole cluster: full
    await queue.enqueue(flood, "f-0")
    assert await ask(admission, flood, "f-0") == "cluster_full"
    for index in range(2):  # light's share: half of four requests
        assert (await admission.admit(light, f"l-{index}", PROMPT, MAX_TOKENS)).admitted
    over = await admission.admit(light, "l-2", PROMPT, MAX_TOKENS)
    assert over.reason == "cluster_full"
    assert await admission.reserved_blocks("light") == 2 * unit
    assert int(await redis.get(keys.cluster_reservation_total) or 0) == 6 * unit
    for index in range(3):  # total 6 -> 3 requests: the flood's ticket now fits
        await release(admission, flood, f"f-run-{index}")
        expected = "admitted" if index == 2 else "cluster_full"
        assert await ask(admission, flood, "f-0") == expected, index
    await queue.check_invariants()


async def test_tenants_arriving_one_by_one_keep_the_cluster_total_bounded(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """One tenant holds the whole cluster (12 requests); seven more arrive one by one and
    each takes what it is admitted. Without a bound each would get capacity / k more
    (31 requests in all); the total stays within twice the capacity, and the first
    newcomer still gets its half share at once."""
    admission, _ = await make(redis, keys, requests_fit=12)
    unit = one_request_blocks(admission)
    tenants = [quota(f"t{index}", 10_000) for index in range(8)]
    for tenant in tenants:
        await store.put_quota(tenant)
    for index in range(12):
        assert (await admission.admit(tenants[0], f"t0-{index}", PROMPT, MAX_TOKENS)).admitted
    got = []
    for tenant in tenants[1:]:
        count = 0
        while (
            await admission.admit(tenant, f"{tenant.tenant_id}-{count}", PROMPT, MAX_TOKENS)
        ).admitted:
            count += 1
            assert count <= 12
        got.append(count)
    total = int(await redis.get(keys.cluster_reservation_total) or 0)
    assert total <= 2 * 12 * unit, (got, total // unit)
    assert got[0] == 6  # t1's share: half the cluster


async def test_a_long_running_tenant_still_counts_as_present(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A tenant whose requests were admitted long ago (no replica report in ``usage``)
    still holds reservations, so it is present: a newcomer of the same weight gets half
    the cluster, not all of it."""
    admission, _ = await make(redis, keys, requests_fit=4)
    old, new = quota("old", 10_000), quota("new", 10_000)
    for tenant in (old, new):
        await store.put_quota(tenant)
    for index in range(4):
        assert (await admission.admit(old, f"old-{index}", PROMPT, MAX_TOKENS)).admitted
    assert not await redis.exists(keys.usage)
    await asyncio.sleep(10.5)  # longer than any "recently admitted" window
    results = [
        (await admission.admit(new, f"new-{i}", PROMPT, MAX_TOKENS)).admitted for i in range(4)
    ]
    assert results == [True, True, False, False]
    # once the old tenant released everything it no longer counts: the newcomer's share
    # is the whole cluster (and the cluster has room)
    for index in range(4):
        await release(admission, old, f"old-{index}")
    assert (await admission.admit(new, "new-9", PROMPT, MAX_TOKENS)).admitted


@pytest.mark.parametrize(("light_weight", "expected"), [(3.0, 6), (1.0 / 3.0, 2)])
async def test_the_share_a_full_cluster_grants_follows_the_weights(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, light_weight: float, expected: int
) -> None:
    """A flood of weight 1 holds the whole cluster (eight requests); a newcomer of weight
    3 is admitted up to 3/4 of it (six), one of weight 1/3 up to 1/4 (two)."""
    admission, _ = await make(redis, keys, requests_fit=8)
    flood, light = quota("flood", 10_000, weight=1.0), quota("light", 10_000, weight=light_weight)
    for tenant in (flood, light):
        await store.put_quota(tenant)
    for index in range(8):
        assert (await admission.admit(flood, f"f-{index}", PROMPT, MAX_TOKENS)).admitted
    count = 0
    while (await admission.admit(light, f"l-{count}", PROMPT, MAX_TOKENS)).admitted:
        count += 1
        assert count <= 8
    assert count == expected


async def test_an_admission_into_a_cluster_with_room_reads_no_other_tenant(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """With room in the cluster the share is not computed: many tenants holding
    reservations cost an admission nothing (no per-tenant read: HGETALL, HKEYS)."""
    admission, _ = await make(redis, keys, requests_fit=200)
    tenants = [quota(f"t{index}", 10_000) for index in range(60)]
    for tenant in tenants:
        await store.put_quota(tenant)
        assert (await admission.admit(tenant, f"{tenant.tenant_id}-0", PROMPT, MAX_TOKENS)).admitted

    async def calls() -> dict[str, int]:
        stats = await redis.info("commandstats")
        return {
            name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("hgetall", "hkeys")
        }

    before = await calls()
    for index in range(1, 5):
        assert (await admission.admit(tenants[0], f"t0-{index}", PROMPT, MAX_TOKENS)).admitted
    assert await calls() == before
