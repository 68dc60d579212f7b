from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.lease import ControllerLease
from controlplane.models import RoutingPlan
from controlplane.plan_follower import PlanFollower
from controlplane.store import RedisStore
from tests.controlplane.fakes import FakeClock


def plan(version: int, created_s: float, keep: float) -> RoutingPlan:
    return RoutingPlan.model_validate(
        {
            "version": version,
            "fence": 1,
            "created_s": created_s,
            "pressure": {
                "r1": {"acme": {"keep_fraction": keep, "target_blocks": 4}},
                "r2": {"other": {"keep_fraction": 0.1, "target_blocks": 1}},
            },
            "allowance": {"r1": {"acme": 8, "beta": 40}, "r2": {"other": 3}},
        }
    )


async def test_the_plan_is_read_only_when_its_version_moved(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, clock: FakeClock
) -> None:
    lease = ControllerLease(redis, "ctl", ttl_s=60, keys=keys)
    await lease.acquire_or_renew()
    follower = PlanFollower(store, "r1", clock, max_age_s=30)
    assert await follower.poll() == {} and follower.plan_reads == 0  # no plan yet
    await lease.write_plan(plan(0, clock.now(), 0.5), {}, usage_ttl_s=60)
    for _ in range(10):
        assert await follower.poll() == {"acme": 0.5}
        clock.advance(1.0)
    assert follower.plan_reads == 1  # ten polls, one read: the version did not move
    await lease.write_plan(plan(1, clock.now(), 0.25), {}, usage_ttl_s=60)
    assert await follower.poll() == {"acme": 0.25} and follower.plan_reads == 2
    assert follower.allowance_now() == {"acme": 8, "beta": 40}  # this replica's only
    clock.advance(31.0)  # no newer plan: its controller is gone, so is its pressure
    assert await follower.poll() == {} and follower.plan_reads == 2
    assert follower.allowance_now() == {}  # and every limit


async def test_an_invalid_plan_is_parsed_once_and_the_last_pressure_kept(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, clock: FakeClock
) -> None:
    lease = ControllerLease(redis, "ctl", ttl_s=60, keys=keys)
    await lease.acquire_or_renew()
    await lease.write_plan(plan(3, clock.now(), 0.5), {}, usage_ttl_s=60)
    follower = PlanFollower(store, "r1", clock)
    assert await follower.poll() == {"acme": 0.5}
    await redis.set(keys.plan, '{"version": 4, "surprise": true}')
    await redis.set(keys.plan_version, 4)
    for _ in range(3):
        assert await follower.poll() == {"acme": 0.5}
    assert follower.plan_reads == 2 and follower.version == 4
    await redis.set(keys.plan_version, "not a number")  # once a ValueError that killed the loop
    assert await follower.poll() == {"acme": 0.5} and follower.version == 4
    with pytest.raises(ValueError, match="max_age_s"):
        PlanFollower(store, "r1", clock, max_age_s=0)
