"""The lapse sweep on a real redis-server: a tenant that sends nothing more stops holding
the cluster's capacity once its reservations lapse; a late renewal still re-reserves; the
cluster's total is set again from the tenants' totals."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from controlplane.admission import Admission, AdmissionConfig, Renewal, Reservation
from controlplane.clock import SystemClock
from controlplane.controller import Controller, ControllerConfig
from controlplane.keys import KeySpace
from controlplane.lapse_sweep import (
    RECONCILE_CLUSTER_TOTAL,
    reconcile_cluster_total,
    sweep_lapsed,
)
from controlplane.lease import ControllerLease
from controlplane.store import RedisStore
from tests.controlplane.builders import quota


async def cluster_total(redis: aioredis.Redis, keys: KeySpace) -> int:
    return int(await redis.get(keys.cluster_reservation_total) or 0)


async def test_lapsed_reservations_of_an_idle_tenant_leave_the_clusters_total(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    short = Admission(redis, AdmissionConfig(block_size=16, reservation_ttl_s=0.2), keys)
    long = Admission(redis, AdmissionConfig(block_size=16), keys)
    idle, busy = quota("idle", 100), quota("busy", 100)
    for tenant in (idle, busy):
        await store.put_quota(tenant)
    lapsing = [await short.admit(idle, f"idle-{i}", 32, 16) for i in range(2)]
    running = await long.admit(busy, "busy-0", 32, 16)
    assert running.reservation is not None
    before = await cluster_total(redis, keys)
    assert before == sum(d.reservation.blocks for d in (*lapsing, running) if d.reservation)
    assert await sweep_lapsed(redis, keys, ["idle", "busy"], 0.2) == 0  # none lapsed yet
    await asyncio.sleep(0.3)
    assert await cluster_total(redis, keys) == before  # nobody of "idle" asked again
    assert await sweep_lapsed(redis, keys, ["idle", "busy"], 600.0) == 2
    assert await cluster_total(redis, keys) == running.reservation.blocks
    assert await short.reserved_blocks("idle") == 0
    late = lapsing[0].reservation
    assert late is not None
    assert await long.renew(late) is Renewal.RESERVED_AGAIN  # its request still ran
    assert await cluster_total(redis, keys) == running.reservation.blocks + late.blocks
    for tenant_id in ("idle", "busy"):
        await long.check_invariants(tenant_id)


async def test_the_leader_sweeps_every_few_cycles(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    short = Admission(redis, AdmissionConfig(block_size=16, reservation_ttl_s=0.1), keys)
    await store.put_quota(quota("idle", 100))
    assert (await short.admit(quota("idle", 100), "idle-0", 32, 16)).admitted
    await asyncio.sleep(0.2)
    config = ControllerConfig(lease_ttl_s=5.0, lapse_sweep_cycles=2, reservation_ttl_s=0.1)
    lease = ControllerLease(redis, "leader", config.lease_ttl_s, keys)
    controller = Controller(store, lease, SystemClock(), config)
    await controller.step()
    assert await cluster_total(redis, keys) > 0  # the first cycle does not sweep
    await controller.step()
    assert await cluster_total(redis, keys) == 0


async def test_a_cluster_total_lost_or_started_late_is_never_negative_and_the_sweep_sets_it(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Reservations taken before the cluster's total existed (an upgrade) are in their
    tenant's total only: their releases leave the cluster's total at 0, not below (it
    would over-admit for good), and the sweep sets it to the tenants' sum."""
    config = AdmissionConfig(block_size=16, cluster_kv_blocks=6)  # two requests of 3 blocks
    admission = Admission(redis, config, keys)
    acme, globex = quota("acme", 100), quota("globex", 100)
    for tenant in (acme, globex):
        await store.put_quota(tenant)
    held = [await admission.admit(acme, f"old-{i}", 32, 16) for i in range(2)]
    assert [d.reservation.blocks for d in held if d.reservation] == [3, 3]
    await redis.delete(keys.cluster_reservation_total)  # what the earlier version left
    assert held[0].reservation is not None
    await admission.release(held[0].reservation)
    assert await cluster_total(redis, keys) == 0
    assert (await admission.admit(globex, "new-0", 32, 16)).admitted  # 6 held, 3 counted
    assert await sweep_lapsed(redis, keys, ["acme", "globex"], 600.0) == 0
    assert await cluster_total(redis, keys) == 6
    refused = await admission.admit(globex, "new-1", 32, 16)
    assert refused.reason == "cluster_full"
    for request_id, tenant_id in (("old-1", "acme"), ("new-0", "globex")):
        await admission.release(Reservation(tenant_id, request_id, 3, 3))
    assert await cluster_total(redis, keys) == 0
    for tenant_id in ("acme", "globex"):
        await admission.check_invariants(tenant_id)


async def test_the_reconciliation_writes_nothing_when_the_tenants_changed_under_it(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """The script names every tenant's total; a tenant created since the list was read
    (its total unnamed) makes it refuse, and the caller reads the tenants again."""
    await store.put_quota(quota("acme", 100))
    await store.put_quota(quota("globex", 100))
    await redis.set(keys.reservation_total("acme"), 4)
    await redis.set(keys.reservation_total("globex"), 5)
    await redis.set(keys.cluster_reservation_total, 1)
    script = redis.register_script(RECONCILE_CLUSTER_TOTAL)
    stale = [keys.quotas, keys.cluster_reservation_total, keys.reservation_total("acme")]
    assert await script(keys=stale, args=["acme"]) == [0, 0]
    assert await cluster_total(redis, keys) == 1
    assert await reconcile_cluster_total(redis, keys) == 9
    assert await cluster_total(redis, keys) == 9
