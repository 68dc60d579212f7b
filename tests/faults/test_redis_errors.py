"""The control loops under Redis error replies, not only lost connections: at `maxmemory`
(`OutOfMemoryError`) and as a read-only replica (`ReadOnlyError`) every loop keeps
running, backs off, and works again once the fault is gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from controlplane.clock import SystemClock
from controlplane.controller import Controller, ControllerConfig
from controlplane.lease import ControllerLease
from controlplane.models import EngineCounters
from controlplane.publisher import PublisherConfig, ReportPublisher
from controlplane.router import RouterConfig, RouterCore
from controlplane.store import RedisStore
from tests.controlplane.builders import quota, report
from tests.faults.redis_faults import FAULTS

pytestmark = pytest.mark.parametrize("fault", sorted(FAULTS))


async def _until(condition: Callable[[], Awaitable[bool] | bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if await value if isinstance(value, Awaitable) else value:
            return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _counters() -> EngineCounters:
    return EngineCounters(block_size=16, total_blocks=10, free_blocks=10, used_blocks=0)


async def test_the_report_publisher_survives_and_its_report_age_shows(
    fault: str, store: RedisStore, admin: aioredis.Redis
) -> None:
    config = PublisherConfig(replica_id="r1", period_s=0.05, backoff_cap_s=0.1)
    publisher = ReportPublisher(store, _counters, SystemClock(), config)
    stop = asyncio.Event()
    task = publisher.start(stop)
    try:
        await _until(lambda: publisher.stats.published > 0)
        async with FAULTS[fault](admin):
            failed = publisher.stats.failed
            await asyncio.sleep(0.4)
            assert not task.done()
            stats = publisher.stats
            assert stats.failed > failed and stats.last_error is not None
            assert stats.last_error.split(":")[0] in ("OutOfMemoryError", "ReadOnlyError")
            age = publisher.report_age_s()
            assert age is not None and age >= 0.3  # visible: nothing reached Redis since
            published = stats.published
        await _until(lambda: publisher.stats.published > published)
        age = publisher.report_age_s()
        assert age is not None and age < 0.3
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)


async def test_the_controller_loop_survives_and_plans_again(
    fault: str, store: RedisStore, admin: aioredis.Redis
) -> None:
    clock = SystemClock()
    await store.put_quota(quota("a"))
    await store.publish_report(report("r1", clock.now()), ttl_s=60)
    config = ControllerConfig(
        period_s=0.02, lease_ttl_s=1.0, report_max_age_s=60, backoff_cap_s=0.1
    )
    lease = ControllerLease(store.redis, "ctl", config.lease_ttl_s, store.keys)
    controller = Controller(store, lease, clock, config)
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await _until(lambda: controller.current_plan is not None)
        async with FAULTS[fault](admin):
            await asyncio.sleep(0.3)
            assert not task.done()
            plan = controller.current_plan
            assert plan is not None
            await asyncio.sleep(0.1)
            assert controller.current_plan == plan  # nothing written while Redis refuses
        await _until(lambda: (controller.current_plan or plan).created_s > plan.created_s)
        assert await store.read_plan() is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)


async def test_the_router_refresh_survives(
    fault: str, store: RedisStore, admin: aioredis.Redis
) -> None:
    clock = SystemClock()
    router = RouterCore(store, clock, RouterConfig(refresh_period_s=0.02, report_refresh_s=0.02))
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    try:
        await _until(lambda: router.redis_ok)
        async with FAULTS[fault](admin):
            await asyncio.sleep(0.3)
            assert not task.done()
        await store.publish_report(report("r1", clock.now()), ttl_s=60)
        await _until(lambda: router.redis_ok)
        await asyncio.sleep(0.1)
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)
