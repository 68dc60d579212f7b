"""The replica's reporter against a real Redis and a fake engine host: every loop survives
its errors, reports reach Redis, the plan is applied, the metrics address is advertised,
and all of it stops when asked."""

from __future__ import annotations

import asyncio

from controlplane.clock import SystemClock
from controlplane.models import EngineCounters
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from serving.replica_reporter import ReplicaReporter
from serving.settings import ReplicaSettings
from tests.redis_server import RedisServer, unique_keys


class FakeHost:
    """An engine host whose first counter read fails (a wedged engine core, once)."""

    def __init__(self) -> None:
        self.replica_id = "replica-1"
        self.settings = ReplicaSettings(model="m", report_period_s=0.01)
        self.counters = EngineCounters(block_size=16, total_blocks=8, free_blocks=8, used_blocks=0)
        self.reads = 0
        self.applied: list[tuple[dict[str, float], dict[str, int]]] = []

    async def refresh_counters(self) -> EngineCounters:
        self.reads += 1
        if self.reads == 1:
            raise RuntimeError("the engine core did not answer")
        return self.counters

    def fresh_counters(self) -> EngineCounters:
        if self.reads < 2:
            raise ValueError("engine counters are not fresh")
        return self.counters

    async def apply_pressure(self, pressure: dict[str, float], allowance: dict[str, int]) -> None:
        self.applied.append((pressure, allowance))


async def test_the_reporter_publishes_follows_the_plan_and_stops(redis_server: RedisServer):
    redis, keys, host = connect(RedisConfig(url=redis_server.url)), unique_keys(), FakeHost()
    store = RedisStore(redis, keys)
    reporter = ReplicaReporter(host, store, SystemClock(), metrics_address="10.0.0.2:9400")  # type: ignore[arg-type]
    running = asyncio.get_running_loop().create_task(reporter.run())
    await asyncio.sleep(0.3)
    assert host.reads >= 3  # the failed read did not stop the polls
    assert reporter.status()["published"] >= 1 and reporter.status()["report_age_s"] < 1
    assert host.applied and host.applied[0] == ({}, {})  # no plan yet: no pressure
    now = SystemClock().now()
    targets = await store.read_metrics_targets(now, keep_s=60)
    assert targets == {"replica-1": ("10.0.0.2:9400", "m")}
    reporter.stop.set()
    await asyncio.wait_for(running, timeout=5)  # every loop ends, the advertiser at once
    await redis.aclose()


async def test_the_plan_loop_survives_any_error_of_a_poll(redis_server: RedisServer):
    """The plan poll ran outside the loop's `try`: one unexpected error ended the loop, and
    the engine kept its last pressure for good."""
    redis, keys, host = connect(RedisConfig(url=redis_server.url)), unique_keys(), FakeHost()
    reporter = ReplicaReporter(host, RedisStore(redis, keys), SystemClock())  # type: ignore[arg-type]
    poll = reporter.plan.poll
    failures = 0

    async def flaky() -> dict[str, float]:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise KeyError("surprise")
        return await poll()

    reporter.plan.poll = flaky  # type: ignore[method-assign]
    running = asyncio.get_running_loop().create_task(reporter.run())
    await asyncio.sleep(0.5)
    assert not running.done() and failures == 2 and host.applied  # polled on after them
    reporter.stop.set()
    await asyncio.wait_for(running, timeout=5)
    await redis.aclose()
