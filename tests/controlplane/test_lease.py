from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.lease import ControllerLease, LeaseHeld, LeaseNotHeld, PlanWrite
from controlplane.models import RoutingPlan
from controlplane.store import RedisStore


def plan(version: int, fence: int) -> RoutingPlan:
    return RoutingPlan(version=version, fence=fence, created_s=1.0)


async def test_one_holder_at_a_time(redis: aioredis.Redis, keys: KeySpace) -> None:
    first = ControllerLease(redis, "ctl-a", ttl_s=5, keys=keys)
    second = ControllerLease(redis, "ctl-b", ttl_s=5, keys=keys)
    assert await first.acquire_or_renew() == LeaseHeld(1)
    assert await second.acquire_or_renew() == LeaseNotHeld("ctl-a")
    assert await first.acquire_or_renew() == LeaseHeld(1)  # renewal keeps the fence
    assert await first.release(1) is True
    assert await second.acquire_or_renew() == LeaseHeld(2)  # a new grant, a new fence


async def test_only_the_holder_writes_and_a_stale_holder_is_rejected(
    redis: aioredis.Redis, keys: KeySpace
) -> None:
    store = RedisStore(redis, keys)
    old = ControllerLease(redis, "ctl-old", ttl_s=0.1, keys=keys)
    new = ControllerLease(redis, "ctl-new", ttl_s=5, keys=keys)
    assert await old.acquire_or_renew() == LeaseHeld(1)
    assert await new.write_plan(plan(0, 1), {}, 60) is PlanWrite.LEASE_LOST
    assert await old.write_plan(plan(0, 1), {"a": 3}, 60) is PlanWrite.WRITTEN
    await asyncio.sleep(0.15)  # the old holder stalls past its lease
    assert await new.acquire_or_renew() == LeaseHeld(2)
    assert await new.write_plan(plan(1, 2), {}, 60) is PlanWrite.WRITTEN
    # The stale holder wakes up and writes with its old fence: refused, plan untouched.
    assert await old.write_plan(plan(2, 1), {"a": 9}, 60) is PlanWrite.LEASE_LOST
    stored = await store.read_plan()
    assert stored is not None and (stored.version, stored.fence) == (1, 2)
    assert await store.read_usage() == {}


async def test_fence_and_version_checks(redis: aioredis.Redis, keys: KeySpace) -> None:
    lease = ControllerLease(redis, "ctl", ttl_s=5, keys=keys)
    held = await lease.acquire_or_renew()
    assert held == LeaseHeld(1)
    assert await lease.write_plan(plan(5, 1), {"t": 2}, 60) is PlanWrite.WRITTEN
    assert await lease.write_plan(plan(5, 1), {}, 60) is PlanWrite.STALE_VERSION
    await redis.set(keys.plan_fence, 7)  # a later fence has written
    assert await lease.write_plan(plan(6, 1), {}, 60) is PlanWrite.STALE_FENCE
    assert await RedisStore(redis, keys).read_usage() == {"t": 2}


def test_bad_lease_arguments(redis: aioredis.Redis) -> None:
    with pytest.raises(ValueError, match="owner"):
        ControllerLease(redis, "a|b", ttl_s=1)
    with pytest.raises(ValueError, match="ttl_s"):
        ControllerLease(redis, "a", ttl_s=0)


async def test_usage_expires_when_no_plan_is_written(redis: aioredis.Redis, keys: KeySpace) -> None:
    lease = ControllerLease(redis, "ctl", ttl_s=5, keys=keys)
    await lease.acquire_or_renew()
    assert await lease.write_plan(plan(0, 1), {"t": 2}, usage_ttl_s=0.2) is PlanWrite.WRITTEN
    assert 0 < await redis.pttl(keys.usage) <= 200
    await asyncio.sleep(0.25)
    assert await RedisStore(redis, keys).read_usage() == {}
    with pytest.raises(ValueError, match="usage_ttl_s"):
        await lease.write_plan(plan(1, 1), {}, usage_ttl_s=0)


async def test_a_lost_fence_counter_cannot_lock_every_writer_out(
    redis: aioredis.Redis, keys: KeySpace
) -> None:
    """The counter is gone (restart without persistence, eviction) and the lease lapsed:
    the next grant still fences above the last plan written, so its writes land."""
    lease = ControllerLease(redis, "ctl-a", ttl_s=5, keys=keys)
    for fence in (1, 2, 3):
        assert await lease.acquire_or_renew() == LeaseHeld(fence)
        await lease.release(fence)
    assert await lease.acquire_or_renew() == LeaseHeld(4)
    assert await lease.write_plan(plan(0, 4), {}, 60) is PlanWrite.WRITTEN
    await redis.delete(keys.lease_fence, keys.lease)
    assert await lease.acquire_or_renew() == LeaseHeld(5)
    assert await lease.write_plan(plan(1, 5), {}, 60) is PlanWrite.WRITTEN
