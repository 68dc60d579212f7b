from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from controlplane.clock import SystemClock
from controlplane.controller import Controller, ControllerConfig
from controlplane.keys import KeySpace
from controlplane.lease import ControllerLease, PlanWrite
from controlplane.placement import PlannerConfig
from controlplane.plan_follower import PlanFollower
from controlplane.redis_conn import REDIS_ERRORS, RedisConfig, connect
from controlplane.router import RouterConfig, RouterCore, RouteSource
from controlplane.store import RedisStore
from tests.controlplane.builders import quota, report
from tests.controlplane.fakes import FakeClock
from tests.redis_server import RedisServer, unique_keys

CONFIG = ControllerConfig(period_s=0.5, lease_ttl_s=5.0, report_max_age_s=0.5)


def make_controller(store: RedisStore, clock: FakeClock | SystemClock, owner: str) -> Controller:
    lease = ControllerLease(store.redis, owner, CONFIG.lease_ttl_s, store.keys)
    return Controller(store, lease, clock, CONFIG)


async def test_quotas_and_plan_survive_a_controller_restart(
    store: RedisStore, clock: FakeClock
) -> None:
    for tenant in ("a", "b", "c"):
        await store.put_quota(quota(tenant, 50))
    await store.publish_reports([report("r1", clock.now()), report("r2", clock.now())], ttl_s=60)
    first = make_controller(store, clock, "ctl-1")
    result = await first.step()
    assert result.leader and result.write is PlanWrite.WRITTEN and result.plan is not None
    placement = {t: route.replicas for t, route in result.plan.tenants.items()}
    await first.shutdown()

    restarted = make_controller(store, clock, "ctl-2")  # a fresh process: nothing in memory
    again = await restarted.step()
    assert again.leader and again.plan is not None
    assert again.plan.version == result.plan.version + 1  # a new leader writes its plan whole
    assert again.plan.fence > result.plan.fence
    assert sorted(await store.list_quotas()) == ["a", "b", "c"]
    assert {t: route.replicas for t, route in again.plan.tenants.items()} == placement
    assert again.num_moves == 0


async def test_only_the_leader_writes(store: RedisStore, clock: FakeClock) -> None:
    await store.put_quota(quota("a"))
    await store.publish_report(report("r1", clock.now()), ttl_s=60)
    leader, standby = make_controller(store, clock, "ctl-a"), make_controller(store, clock, "ctl-b")
    versions = []
    for cycle in range(4):
        if cycle == 2:  # the plan's content changes: a new tenant
            await store.put_quota(quota("b"))
        led = await leader.step()
        followed = await standby.step()
        assert led.leader and not followed.leader and followed.write is None
        assert led.plan is not None and followed.plan is not None
        assert followed.plan.version == led.plan.version  # the standby serves the leader's plan
        assert followed.plan.same_content(led.plan)
        versions.append(led.plan.version)
    # The version moves with the content only: readers that follow it parse nothing new.
    assert versions == [0, 0, 1, 1] and leader.is_leader and not standby.is_leader


async def test_stale_replica_leaves_within_two_periods_and_returns(
    store: RedisStore, clock: FakeClock
) -> None:
    await store.put_quota(quota("a"))
    await store.put_quota(quota("b"))
    controller = make_controller(store, clock, "ctl")

    async def cycle(reporting: list[str]) -> tuple[str, ...]:
        reports = [report(r, clock.now()) for r in reporting]
        await store.publish_reports(reports, ttl_s=60)
        result = await controller.step()
        assert result.plan is not None
        clock.advance(CONFIG.period_s)
        return result.plan.replica_ids

    assert await cycle(["r1", "r2", "r3"]) == ("r1", "r2", "r3")
    assert await cycle(["r1", "r2"]) == ("r1", "r2", "r3")  # r3 last reported 1 period ago
    assert await cycle(["r1", "r2"]) == ("r1", "r2")  # gone by the second period
    plan = controller.current_plan
    assert plan is not None and plan.drained_replica_ids == ("r3",)
    assert all(w.replica_id != "r3" for route in plan.tenants.values() for w in route.replicas)
    assert await cycle(["r1", "r2", "r3"]) == ("r1", "r2", "r3")  # back when it reports


async def _wait_for(condition: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_redis_restart_mid_loop(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    keys: KeySpace = unique_keys()
    client: aioredis.Redis = connect(RedisConfig(url=server.url, socket_timeout_s=0.5))
    store = RedisStore(client, keys)
    clock = SystemClock()
    config = ControllerConfig(period_s=0.05, lease_ttl_s=1.0, report_max_age_s=1.0)
    lease = ControllerLease(client, "ctl", config.lease_ttl_s, keys)
    controller = Controller(store, lease, clock, config)
    router = RouterCore(store, clock, RouterConfig(refresh_period_s=0.05, max_plan_age_s=2))
    quotas = {t: quota(t, 40) for t in ("a", "b", "c")}
    for tenant in quotas.values():
        await store.put_quota(tenant)
    stop = asyncio.Event()

    async def publish_forever() -> None:
        while not stop.is_set():
            try:
                reports = [report(r, clock.now(), {"a": 3}) for r in ("r1", "r2")]
                await store.publish_reports(reports, ttl_s=1.0)
            except REDIS_ERRORS:
                pass  # Redis is down: the next period tries again
            await asyncio.sleep(0.05)

    tasks = [
        asyncio.create_task(controller.run(stop)),
        asyncio.create_task(router.run(stop)),
        asyncio.create_task(publish_forever()),
    ]
    try:

        async def has_plan() -> bool:
            plan = controller.current_plan
            return plan is not None and router.plan is not None and len(router.plan.tenants) == 3

        await _wait_for(has_plan)
        assert router.rank("a", {"r1", "r2"}).source is RouteSource.PLAN
        server.stop()
        await asyncio.sleep(0.1)  # a cycle in flight when Redis went away ends first
        last = controller.current_plan
        await asyncio.sleep(0.5)  # the loops keep running against a dead Redis
        assert not any(task.done() for task in tasks)
        assert controller.current_plan == last  # the last plan is still served
        ranking = router.rank("a", {"r1", "r2"})
        assert ranking.source is RouteSource.REDIS_UNREACHABLE and ranking.ranks[0]
        server.start()  # same port, same directory

        async def resumed() -> bool:
            plan = controller.current_plan
            # Planning again: its heartbeat moves (the version only if the content changed).
            return plan is not None and last is not None and plan.created_s > last.created_s + 1

        await _wait_for(resumed)
        await _wait_for(lambda: _router_back(router))
        assert await store.list_quotas() == quotas
        assert await store.read_usage() == {"a": 6}
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        await client.aclose()
        server.stop()


async def _router_back(router: RouterCore) -> bool:
    return router.rank("a", {"r1", "r2"}).source is RouteSource.PLAN


async def test_rebalancing_through_redis_moves_once_and_stays(
    store: RedisStore, clock: FakeClock
) -> None:
    for tenant in ("a", "b", "c"):
        await store.put_quota(quota(tenant, 1000))
    lease = ControllerLease(store.redis, "ctl", CONFIG.lease_ttl_s, store.keys)
    never_hot = PlannerConfig(hot_tenant_fraction=1.0)
    controller = Controller(store, lease, clock, CONFIG, never_hot)

    async def cycle(held: dict[str, dict[str, int]]) -> dict[str, list[str]]:
        await store.publish_reports([report(r, clock.now(), t) for r, t in held.items()], 60)
        result = await controller.step()
        clock.advance(CONFIG.period_s)
        assert result.plan is not None
        return {t: [w.replica_id for w in r.replicas] for t, r in result.plan.tenants.items()}

    first = await cycle({"r1": {}, "r2": {}})
    assert first == {"a": ["r1"], "b": ["r2"], "c": ["r1"]}
    overloaded = {"r1": {"a": 60, "c": 35}, "r2": {"b": 5}}  # r1 at 95% > 90%
    moved = await cycle(overloaded)
    assert moved == {"a": ["r2"], "b": ["r2"], "c": ["r1"]}  # the largest tenant moves
    for _ in range(3):  # a's old KV is still reported on r1: nothing moves back
        assert await cycle(overloaded) == moved
    for _ in range(3):  # settled on r2, r1 nearly empty: a stays (hysteresis)
        assert await cycle({"r1": {"c": 35}, "r2": {"a": 60, "b": 5}}) == moved


def test_bad_controller_config() -> None:
    with pytest.raises(ValueError, match="lease_ttl_s"):
        ControllerConfig(period_s=1.0, lease_ttl_s=1.0)
    with pytest.raises(ValueError, match="positive"):
        ControllerConfig(period_s=0)


async def test_leader_replaces_an_invalid_stored_plan(store: RedisStore, clock: FakeClock) -> None:
    await store.put_quota(quota("a"))
    await store.publish_report(report("r1", clock.now()), ttl_s=60)
    await store.redis.set(store.keys.plan, "not json")
    await store.redis.set(store.keys.plan_version, 41)
    result = await make_controller(store, clock, "ctl").step()
    assert result.write is PlanWrite.WRITTEN and result.plan is not None
    assert result.plan.version == 42
    stored = await store.read_plan()
    assert stored is not None and stored.tenants["a"].replicas[0].replica_id == "r1"


async def test_a_stopped_controller_leaves_no_frozen_usage(
    store: RedisStore, clock: FakeClock
) -> None:
    """The usage admission reads expires when no controller writes plans any more, so a
    tenant is not throttled forever by the last numbers a dead controller measured."""
    from controlplane.admission import Admission, AdmissionConfig

    config = ControllerConfig(period_s=0.05, lease_ttl_s=1.0, usage_ttl_s=0.3)
    tenant = quota("a", budget=10)
    await store.put_quota(tenant)
    await store.publish_report(report("r1", clock.now(), {"a": 9}), ttl_s=60)
    lease = ControllerLease(store.redis, "ctl", config.lease_ttl_s, store.keys)
    result = await Controller(store, lease, clock, config).step()
    assert result.write is PlanWrite.WRITTEN
    assert await store.read_usage() == {"a": 9}
    admission = Admission(store.redis, AdmissionConfig(block_size=16), store.keys)
    assert (await admission.admit(tenant, "r1", 32, 0)).reason == "kv_budget"  # 9 + 2 > 10
    await asyncio.sleep(0.35)  # the controller is gone: nobody measures any more
    assert await store.read_usage() == {}
    assert (await admission.admit(tenant, "r1", 32, 0)).admitted
    with pytest.raises(ValueError, match="usage_ttl_s"):
        ControllerConfig(period_s=1.0, lease_ttl_s=2.0, usage_ttl_s=1.0)


async def test_an_unchanged_plan_is_not_rewritten_and_its_heartbeat_keeps_readers_current(
    store: RedisStore, clock: FakeClock
) -> None:
    """Every cycle once moved the version, so every replica re-parsed the whole plan (1.5 MB,
    152 ms at 1,000 x 10,000). Now the version moves with the content; the heartbeat keeps
    routers on the plan and followers' pressure alive past their max ages meanwhile."""
    await store.put_quota(quota("a"))
    controller = make_controller(store, clock, "ctl")
    router = RouterCore(store, clock, RouterConfig(max_plan_age_s=2.0))
    follower = PlanFollower(store, "r1", clock, max_age_s=3.0)
    for _ in range(8):
        await store.publish_report(report("r1", clock.now(), {"a": 3}), ttl_s=60)
        assert (await controller.step()).write is PlanWrite.WRITTEN
        await router.refresh()
        await follower.poll()
        clock.advance(1.0)
    assert (await store.read_plan_version()) == 0 and follower.slice_reads == 1
    assert router.rank("a", frozenset({"r1"})).source is RouteSource.PLAN  # 8 s, max age 2 s
    head = await store.read_plan_head()
    assert head.heartbeat_s == pytest.approx(clock.now() - 1.0)
    clock.advance(2.5)  # no controller any more: the heartbeat stops
    await router.refresh()
    assert router.rank("a", frozenset({"r1"})).source is RouteSource.NO_PLAN
    # Redis lost the plan: the unchanged write is refused, the next cycle writes it whole.
    await store.redis.delete(store.keys.plan, store.keys.plan_version)
    await store.publish_report(report("r1", clock.now(), {"a": 3}), ttl_s=60)
    assert (await controller.step()).write is PlanWrite.PLAN_MISSING
    assert (await controller.step()).write is PlanWrite.WRITTEN
    assert (await store.read_plan_version()) == 1 and await store.read_plan() is not None


async def test_the_heartbeat_freshens_only_the_plan_it_belongs_to(
    store: RedisStore, clock: FakeClock
) -> None:
    """A reader that could not take the leader's latest version (it did not parse) must not
    treat the plan it still holds as current because the heartbeat moves."""
    await store.put_quota(quota("a"))
    await store.publish_report(report("r1", clock.now(), {"a": 3}), ttl_s=60)
    controller = make_controller(store, clock, "ctl")
    router = RouterCore(store, clock, RouterConfig(max_plan_age_s=2.0))
    follower = PlanFollower(store, "r1", clock, max_age_s=3.0)
    await controller.step()
    await router.refresh()
    await follower.poll()
    held = await store.read_plan()
    assert held is not None and router.plan == held
    await store.redis.set(store.keys.plan, '{"version": 9, "surprise": true}')
    await store.redis.set(store.keys.plan_version, 9)
    await store.redis.hset(store.keys.plan_slices, "r1", '{"version": 9, "surprise": true}')
    for _ in range(5):  # the leader's heartbeat keeps moving; its plan is unreadable here
        clock.advance(1.0)
        await store.redis.set(store.keys.plan_heartbeat, repr(clock.now()))
        await router.refresh()
        await follower.poll()
    assert router.plan == held
    assert router.rank("a", frozenset({"r1"})).source is RouteSource.NO_PLAN
    assert follower.pressure_now() == {} and follower.allowance_now() == {}


async def test_a_lost_plan_key_or_a_foreign_version_is_rewritten(
    store: RedisStore, clock: FakeClock
) -> None:
    await store.put_quota(quota("a"))
    controller = make_controller(store, clock, "ctl")
    for _ in range(2):
        await store.publish_report(report("r1", clock.now(), {"a": 3}), ttl_s=60)
        assert (await controller.step()).write is PlanWrite.WRITTEN
    await store.redis.delete(store.keys.plan)  # the version key stays
    assert (await controller.step()).write is PlanWrite.PLAN_MISSING
    assert (await controller.step()).write is PlanWrite.WRITTEN
    assert await store.read_plan() is not None
    await store.redis.set(store.keys.plan_version, "4.5x")  # not ours, not a number
    assert (await controller.step()).write is PlanWrite.PLAN_MISSING
    assert (await controller.step()).write is PlanWrite.WRITTEN
    assert await store.read_plan_version() == 2


async def test_a_cycle_that_raises_does_not_end_the_loop(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad value anywhere in a cycle (once: a 310-digit budget overflowing a float) is
    logged and retried; the loop lives on."""
    controller = make_controller(store, SystemClock(), "ctl")
    failures = 0

    async def fails() -> None:
        nonlocal failures
        failures += 1
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(controller, "step", fails)
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    await asyncio.sleep(0.3)
    assert not task.done() and failures >= 2
    stop.set()
    await asyncio.wait_for(task, 5)
