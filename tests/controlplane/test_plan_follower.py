from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.lease import ControllerLease, PlanWrite
from controlplane.models import PlanSlice, RoutingPlan
from controlplane.plan_follower import PlanFollower
from controlplane.plan_slices import slice_update
from controlplane.store import RedisStore
from tests.controlplane.fakes import FakeClock


def plan(version: int, created_s: float, keep: float, others: bool = True) -> RoutingPlan:
    return RoutingPlan.model_validate(
        {
            "version": version,
            "fence": 1,
            "created_s": created_s,
            "replica_ids": ["r1", "r2"] if others else ["r1"],
            "pressure": {
                "r1": {"acme": {"keep_fraction": keep, "target_blocks": 4}},
                **({"r2": {"other": {"keep_fraction": 0.1, "target_blocks": 1}}} if others else {}),
            },
            "allowance": {
                "r1": {"acme": 8, "beta": 40},
                **({"r2": {"other": 3}} if others else {}),
            },
        }
    )


async def leader(redis: aioredis.Redis, keys: KeySpace) -> ControllerLease:
    lease = ControllerLease(redis, "ctl", ttl_s=60, keys=keys)
    await lease.acquire_or_renew()
    return lease


async def test_a_replica_reads_only_its_slice_and_parses_it_only_when_it_changed(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, clock: FakeClock
) -> None:
    """Every replica once parsed the whole plan (1.5 MB, ~150 ms at 1,000 x 10,000) each
    time its usage-derived fields moved, which under traffic is every controller cycle."""
    lease = await leader(redis, keys)
    follower = PlanFollower(store, "r1", clock, max_age_s=30)
    assert await follower.poll() == {} and follower.slice_reads == 0  # no plan yet
    await lease.write_plan(plan(0, clock.now(), 0.5), {}, usage_ttl_s=60)
    read = await store.read_plan_slice("r1")
    assert read.raw_slice is not None and len(read.raw_slice) < 200  # not the whole plan
    for _ in range(10):
        assert await follower.poll() == {"acme": 0.5}
        clock.advance(1.0)
    assert follower.slice_reads == 1  # ten polls, one parse: the slice did not change
    await lease.write_plan(plan(1, clock.now(), 0.25), {}, usage_ttl_s=60)
    assert await follower.poll() == {"acme": 0.25} and follower.slice_reads == 2
    assert follower.allowance_now() == {"acme": 8, "beta": 40}  # this replica's only
    assert follower.version == 1
    clock.advance(31.0)  # no newer plan: its controller is gone, so is its pressure
    assert await follower.poll() == {} and follower.slice_reads == 2
    assert follower.allowance_now() == {}  # and every limit


async def test_only_changed_slices_are_written_and_those_of_replicas_that_left_removed(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, clock: FakeClock
) -> None:
    lease = await leader(redis, keys)
    first = plan(0, clock.now(), 0.5)
    await lease.write_plan(first, {}, usage_ttl_s=60)
    r2 = PlanFollower(store, "r2", clock)
    assert await r2.poll() == {"other": 0.1}
    clock.advance(1.0)
    second = plan(1, clock.now(), 0.5, others=False)  # r1 unchanged, r2 left
    update = slice_update(second, first)
    assert update.upserts == {} and update.removed == ("r2",) and update.expected_count == 2
    assert await lease.write_plan(second, {}, 60, slices=update) is PlanWrite.WRITTEN
    assert await redis.hkeys(keys.plan_slices) == ["r1"]
    kept = PlanSlice.model_validate_json((await store.read_plan_slice("r1")).raw_slice or "")
    assert kept.version == 0  # not rewritten: its content did not change
    assert await r2.poll() == {} and r2.allowance_now() == {}  # not in the plan any more
    # A difference whose base is not what is stored (lost, or of another type) is refused
    # untouched, and the next write is whole.
    await redis.delete(keys.plan_slices)
    await redis.set(keys.plan_slices, "foreign")
    third = plan(2, clock.now(), 0.25, others=False)
    refused = await lease.write_plan(third, {}, 60, slices=slice_update(third, second))
    assert refused is PlanWrite.PLAN_MISSING and await redis.get(keys.plan_slices) == "foreign"
    assert await PlanFollower(store, "r1", clock).poll() == {}  # no WRONGTYPE error either
    assert await lease.write_plan(third, {}, 60) is PlanWrite.WRITTEN
    assert await PlanFollower(store, "r1", clock).poll() == {"acme": 0.25}


async def test_a_stale_writer_cannot_write_slices(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, clock: FakeClock
) -> None:
    old = await leader(redis, keys)
    await old.write_plan(plan(0, clock.now(), 0.5), {}, usage_ttl_s=60)
    await redis.delete(keys.lease)
    new = ControllerLease(redis, "ctl-2", ttl_s=60, keys=keys)
    await new.acquire_or_renew()
    outcome = await old.write_plan(plan(1, clock.now(), 0.1), {}, usage_ttl_s=60)
    assert outcome is PlanWrite.LEASE_LOST
    assert await PlanFollower(store, "r1", clock).poll() == {"acme": 0.5}


async def test_an_invalid_slice_is_parsed_once_and_ages_out(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, clock: FakeClock
) -> None:
    lease = await leader(redis, keys)
    await lease.write_plan(plan(3, clock.now(), 0.5), {}, usage_ttl_s=60)
    follower = PlanFollower(store, "r1", clock, max_age_s=3)
    assert await follower.poll() == {"acme": 0.5}
    await redis.hset(keys.plan_slices, "r1", '{"version": 4, "surprise": true}')
    for _ in range(3):
        assert await follower.poll() == {"acme": 0.5}
    assert follower.slice_reads == 2 and follower.version == 3
    for _ in range(4):  # the heartbeat moves, but it no longer vouches for what is held
        clock.advance(1.0)
        await redis.set(keys.plan_heartbeat, repr(clock.now()))
        await follower.poll()
    assert follower.pressure_now() == {} and follower.allowance_now() == {}
    await redis.set(keys.plan_heartbeat, "not a number")  # logged, never a dead loop
    assert await follower.poll() == {}
    with pytest.raises(ValueError, match="max_age_s"):
        PlanFollower(store, "r1", clock, max_age_s=0)


async def test_any_error_while_polling_is_logged_and_what_was_known_kept(
    redis: aioredis.Redis,
    keys: KeySpace,
    store: RedisStore,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only Redis errors were caught: any other error ended the engine's plan loop."""
    lease = await leader(redis, keys)
    await lease.write_plan(plan(0, clock.now(), 0.5), {}, usage_ttl_s=60)
    follower = PlanFollower(store, "r1", clock)
    assert await follower.poll() == {"acme": 0.5}

    async def broken(replica_id: str) -> None:
        raise KeyError(replica_id)

    monkeypatch.setattr(store, "read_plan_slice", broken)
    assert await follower.poll() == {"acme": 0.5}
