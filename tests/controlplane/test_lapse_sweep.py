"""The lapse sweep on a real redis-server: a tenant that sends nothing more stops holding
the cluster's capacity once its reservations lapse; a late renewal still re-reserves."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from controlplane.admission import Admission, AdmissionConfig, Renewal
from controlplane.clock import SystemClock
from controlplane.controller import Controller, ControllerConfig
from controlplane.keys import KeySpace
from controlplane.lapse_sweep import sweep_lapsed
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
