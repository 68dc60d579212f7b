from __future__ import annotations

import asyncio

import pytest

from controlplane.models import RoutingPlan
from controlplane.redis_conn import RedisConfig, connect
from controlplane.router import RouterConfig, RouterCore, RouteSource
from controlplane.store import RedisStore
from tests.controlplane.builders import report
from tests.controlplane.fakes import FakeClock
from tests.redis_server import free_port, unique_keys


def plan(version: int = 1, drained: tuple[str, ...] = ()) -> RoutingPlan:
    return RoutingPlan.model_validate(
        {
            "version": version,
            "fence": 1,
            "created_s": 0.0,
            "replica_ids": ["r1", "r2", "r3", "r4"],
            "drained_replica_ids": list(drained),
            "tenants": {
                "a": {
                    "replicas": [
                        {"replica_id": "r1", "weight": 0.6},
                        {"replica_id": "r2", "weight": 0.4},
                    ]
                },
                "b": {"replicas": [{"replica_id": "r3", "weight": 1.0}]},
            },
        }
    )


@pytest.fixture
def router(store: RedisStore, clock: FakeClock) -> RouterCore:
    core = RouterCore(store, clock, RouterConfig(max_plan_age_s=5, fallback_width=2))
    core.apply_plan(plan())
    core.apply_reports(
        {
            "r1": report("r1", clock.now(), queue_depth=5),
            "r2": report("r2", clock.now(), queue_depth=1),
            "r3": report("r3", clock.now(), queue_depth=9),
            "r4": report("r4", clock.now(), queue_depth=0),
        }
    )
    return core


ALL = frozenset({"r1", "r2", "r3", "r4"})


def test_warm_set_first_least_queued_then_least_loaded(router: RouterCore) -> None:
    ranking = router.rank("a", ALL)
    assert ranking.source is RouteSource.PLAN and ranking.plan_version == 1
    assert ranking.ranks == (("r2", "r1"), ("r4", "r3"))
    # The caller's live queue lengths override the reports.
    assert router.rank("a", ALL, {"r1": 0, "r2": 3}).ranks[0] == ("r1", "r2")


def test_only_candidates_are_ranked(router: RouterCore) -> None:
    assert router.rank("a", frozenset({"r1", "r3"})).ranks == (("r1",), ("r3",))
    unreachable_warm = router.rank("b", frozenset({"r1", "r2"}))
    assert unreachable_warm.source is RouteSource.NOT_IN_PLAN
    assert unreachable_warm.ranks == (("r2", "r1"),)
    assert router.rank("a", frozenset()).ranks == ()


def test_unknown_tenant_falls_back_to_least_loaded(router: RouterCore) -> None:
    ranking = router.rank("nobody", ALL)
    assert ranking.source is RouteSource.NOT_IN_PLAN and ranking.ranks == (("r4", "r2"),)


def test_stale_plan_falls_back(router: RouterCore, clock: FakeClock) -> None:
    clock.advance(5.1)
    ranking = router.rank("b", ALL)
    assert ranking.source is RouteSource.NO_PLAN and ranking.ranks == (("r4", "r2"),)
    router.apply_plan(plan(version=2))  # a new version makes it fresh again
    assert router.rank("b", ALL).ranks[0] == ("r3",)


def test_drained_replicas_go_last_in_fallback(router: RouterCore) -> None:
    router.apply_plan(plan(drained=("r4",)))
    assert router.rank("nobody", ALL).ranks == (("r2", "r1"),)
    assert router.rank("nobody", frozenset({"r4"})).ranks == (("r4",),)


def test_load_order_is_cached_per_candidate_set(store: RedisStore, clock: FakeClock) -> None:
    core = RouterCore(store, clock, RouterConfig(fallback_width=3))
    reports = {f"r{i}": report(f"r{i}", clock.now(), queue_depth=100 - i) for i in range(50)}
    core.apply_reports(reports)
    everyone = frozenset(reports) | {"new"}  # "new" has no report yet: load 0
    assert core.rank("x", everyone).ranks == (("new", "r49", "r48"),)
    assert core.rank("x", everyone).ranks == (("new", "r49", "r48"),)  # from the cache
    core.apply_reports({**reports, "new": report("new", clock.now(), queue_depth=500)})
    assert core.rank("x", everyone).ranks == (("r49", "r48", "r47"),)  # reports reset it
    live = {**{r: 5 for r in everyone}, "r7": 1}
    assert core.rank("x", everyone, live).ranks[0][0] == "r7"  # caller's queue lengths


async def test_refresh_reads_plan_and_reports_and_survives_errors(
    store: RedisStore, clock: FakeClock
) -> None:
    core = RouterCore(store, clock, RouterConfig())
    assert await core.refresh() and core.plan is None
    assert core.rank("a", ALL).source is RouteSource.NO_PLAN
    await store.redis.set(store.keys.plan, plan(version=4).model_dump_json())
    await store.redis.set(store.keys.plan_version, 4)
    reports = [report(r, clock.now(), queue_depth=q) for r, q in [("r1", 5), ("r2", 3), ("r4", 0)]]
    await store.publish_reports(reports, ttl_s=60)
    clock.advance(1.0)
    assert await core.refresh()
    assert core.plan is not None and core.plan.version == 4
    assert core.rank("nobody", frozenset({"r1", "r2", "r4"})).ranks == (("r4", "r2", "r1"),)


async def test_unreachable_redis_falls_back_and_keeps_the_plan(clock: FakeClock) -> None:
    dead = connect(RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", command_retries=0))
    core = RouterCore(RedisStore(dead, unique_keys()), clock, RouterConfig())
    core.apply_plan(plan(version=7))
    assert core.rank("b", ALL).source is RouteSource.PLAN
    assert not await core.refresh()
    ranking = core.rank("b", ALL)
    assert not core.redis_ok and ranking.source is RouteSource.REDIS_UNREACHABLE
    assert ranking.plan_version == 7 and len(ranking.ranks[0]) == core.config.fallback_width
    await dead.aclose()


async def test_a_non_integer_plan_version_keeps_the_plan(
    store: RedisStore, clock: FakeClock
) -> None:
    """A version that is not an integer once raised ValueError in the refresh loop, which
    catches only Redis errors: the loop died."""
    core = RouterCore(store, clock, RouterConfig())
    core.apply_plan(plan(version=3))
    await store.redis.set(store.keys.plan_version, "4.5x")
    assert await core.refresh() and core.redis_ok
    assert core.plan is not None and core.plan.version == 3


async def test_an_invalid_plan_is_ignored(store: RedisStore, clock: FakeClock) -> None:
    core = RouterCore(store, clock, RouterConfig())
    core.apply_plan(plan(version=3))
    await store.redis.set(store.keys.plan, '{"version": 4, "surprise": true}')
    await store.redis.set(store.keys.plan_version, 4)
    assert await core.refresh() and core.redis_ok
    assert core.plan is not None and core.plan.version == 3
    assert core.rank("b", ALL).ranks[0] == ("r3",)


async def test_refresh_reads_prefix_keys_only_when_they_changed(
    store: RedisStore, clock: FakeClock
) -> None:
    """Each router once read and validated every replica's 1,024 keys every second."""
    core = RouterCore(store, clock, RouterConfig(report_refresh_s=1.0))
    keys = tuple(f"{i:016x}" for i in range(8))
    everyone = frozenset({"r1", "r2"})
    await store.publish_reports(
        [report("r1", clock.now(), prefix_keys=keys), report("r2", clock.now())], 60
    )
    assert await core.refresh()
    assert core.rank("a", everyone, prefix_keys=keys[:4]).ranks[0] == ("r1",)
    read = store.read_prefix_keys
    asked: list[dict[str, str]] = []

    async def counting(known: dict[str, str]) -> object:
        asked.append(dict(known))
        return await read(known)

    store.read_prefix_keys = counting  # type: ignore[method-assign]
    clock.advance(1.0)
    await store.publish_reports(
        [report("r1", clock.now(), prefix_keys=keys), report("r2", clock.now())], 60
    )
    assert await core.refresh()
    assert all(tag for tag in asked[-1].values())  # the tags held: only changes come back
    assert core.rank("a", everyone, prefix_keys=keys[:4]).ranks[0] == ("r1",)
    clock.advance(1.5)  # r1's keys move to r2; r1 stops reporting
    await store.publish_reports([report("r2", clock.now(), prefix_keys=keys)], 60)
    assert await core.refresh()
    assert core.rank("a", frozenset({"r2"}), prefix_keys=keys[:4]).source is RouteSource.PREFIX
    assert core.rank("a", everyone, prefix_keys=keys[:4]).ranks[0] == ("r2",)


async def test_the_refresh_loop_survives_any_error(
    store: RedisStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop caught only Redis errors: any other one ended it, and the router routed on
    a frozen plan for good."""
    core = RouterCore(store, clock, RouterConfig(refresh_period_s=0.1))
    await store.redis.set(store.keys.plan, plan(version=4).model_dump_json())
    await store.redis.set(store.keys.plan_version, 4)
    read_head = store.read_plan_head
    failures = 0

    async def flaky() -> object:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise KeyError("surprise")
        return await read_head()

    monkeypatch.setattr(store, "read_plan_head", flaky)
    stop = asyncio.Event()
    task = asyncio.create_task(core.run(stop))
    for _ in range(500):
        await asyncio.sleep(0.01)
        if core.plan is not None or task.done():
            break
    stop.set()
    await asyncio.wait_for(task, timeout=5)  # once raised the KeyError: the loop had died
    assert failures == 2 and core.plan is not None and core.plan.version == 4
