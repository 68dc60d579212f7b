from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from controlplane.clock import SystemClock
from controlplane.models import EngineCounters, TenantUsage
from controlplane.publisher import PublisherConfig, ReportPublisher
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from tests.redis_server import RedisServer, free_port, unique_keys


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    # Not persistent: these tests hold writes to 20 ms deadlines, and with appendfsync
    # everysec Redis postpones writes while a slow background fsync runs (a busy disk).
    with RedisServer(Path(tmp_path_factory.mktemp("redis")), persistent=False) as server:
        yield server


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    client = connect(RedisConfig(url=redis_server.url))
    yield RedisStore(client, unique_keys())
    await client.aclose()


class Engine:
    """Stands in for an engine's counters: plain numbers the loop mutates."""

    def __init__(self) -> None:
        self.free_blocks = 90
        self.calls = 0

    def counters(self) -> EngineCounters:
        self.calls += 1
        return EngineCounters(
            block_size=16,
            total_blocks=100,
            free_blocks=self.free_blocks,
            used_blocks=100 - self.free_blocks,
            reclaimable_blocks=2,
            tenants={"acme": TenantUsage(blocks=100 - self.free_blocks, requests=1)},
        )


async def _engine_loop_max_lag_s(duration_s: float, tick_s: float = 0.005) -> float:
    """Run a fake engine loop; return the worst lateness of its ticks."""
    worst = 0.0
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        before = time.perf_counter()
        await asyncio.sleep(tick_s)
        worst = max(worst, time.perf_counter() - before - tick_s)
    return worst


async def test_publishes_every_period_with_a_ttl(store: RedisStore) -> None:
    engine = Engine()
    config = PublisherConfig(replica_id="replica-1", model_id="smollm2", period_s=0.05)
    publisher = ReportPublisher(store, engine.counters, SystemClock(), config)
    stop = asyncio.Event()
    task = publisher.start(stop)
    lag_s = await _engine_loop_max_lag_s(0.5)
    engine.free_blocks = 70
    await asyncio.sleep(0.15)
    stop.set()
    await asyncio.wait_for(task, 1)
    # One attempt a period (about 13 in 0.65 s). A write slower than its one-period
    # deadline is dropped and counted, which a loaded machine does now and then: most
    # attempts must land, not all.
    stats = publisher.stats
    assert 8 <= stats.published + stats.failed <= 20 and stats.failed <= 2
    assert lag_s < 0.2  # a synchronous client would stall it on connects and retry sleeps
    snapshot = await store.read_reports(time.time(), max_age_s=1.0, forget_after_s=60)
    published = snapshot.fresh["replica-1"]
    assert published.model_id == "smollm2" and published.used_blocks == 30
    assert published.tenants["acme"].blocks == 30 and published.available_blocks == 72
    assert 0 < await store.redis.pttl(store.keys.replica("replica-1")) <= 150  # 3 periods


async def test_never_blocks_or_raises_while_redis_is_away() -> None:
    dead = connect(RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", command_retries=0))
    engine = Engine()
    config = PublisherConfig(replica_id="replica-1", period_s=0.02, backoff_cap_s=0.1)
    publisher = ReportPublisher(
        RedisStore(dead, unique_keys()), engine.counters, SystemClock(), config
    )
    stop = asyncio.Event()
    task = publisher.start(stop)
    lag_s = await _engine_loop_max_lag_s(0.4)
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 1)
    stats = publisher.stats
    assert stats.published == 0 and 2 <= stats.failed <= 20  # backed off, not spinning
    assert stats.last_error is not None and "Connection" in stats.last_error
    assert lag_s < 0.2  # a synchronous client would stall it on connects and retry sleeps
    await dead.aclose()


async def test_inconsistent_counters_are_dropped_not_raised(store: RedisStore) -> None:
    engine = Engine()
    engine.free_blocks = 150  # more free than total: the engine's bug, not ours to crash on
    config = PublisherConfig(replica_id="replica-2", period_s=0.02)
    publisher = ReportPublisher(store, engine.counters, SystemClock(), config)
    assert await publisher.publish_once() is False
    assert publisher.stats.failed == 1 and "ValidationError" in (publisher.stats.last_error or "")


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"replica_id": ""}, "replica_id"), ({"replica_id": "r", "period_s": 0}, "period_s")],
)
def test_bad_config(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PublisherConfig(**fields)  # type: ignore[arg-type]


async def test_any_error_of_the_counters_is_counted_and_the_loop_goes_on(
    store: RedisStore,
) -> None:
    """Only Redis errors, timeouts and `ValueError` were caught: any other error of the
    engine's counters (a `KeyError` of a request that finished meanwhile) ended the loop."""
    engine = Engine()
    raised = 0

    def counters() -> EngineCounters:
        nonlocal raised
        if raised < 2:
            raised += 1
            raise KeyError("request-7")
        return engine.counters()

    config = PublisherConfig(replica_id="replica-3", period_s=0.25)  # no write times out
    publisher = ReportPublisher(store, counters, SystemClock(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    for _ in range(500):
        await asyncio.sleep(0.01)
        if publisher.stats.published or task.done():
            break
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    assert publisher.stats.failed == 2 and publisher.stats.published >= 1
    assert "KeyError" in (publisher.stats.last_error or "")
