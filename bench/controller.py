"""`vtoken bench controller`: routing latency, plan time and report ingestion at scale.

Synthetic replica reports and tenant quotas go through the same code path as production:
`RedisStore.publish_reports` / `read_reports` against a real redis-server (started here
unless `--redis-url` is given), `Controller.step` and `compute_plan` for the plan, and
`RouterCore.rank` for routing decisions (in process, candidates = every replica).

Each report carries as many prefix keys as a replica's pool has blocks (at most
`MAX_REPORTED_KEYS`: `prefix_keys_per_report`). A busy replica's keys change with every
report, but are written at most once a second (`PublisherConfig.prefix_keys_period_s`)
while it reports ten times a second: in each cycle a tenth of the replicas (in turn)
write new keys (`prefix_keys_written_fraction`); the others' are unchanged. Writing
every replica's new keys at once is timed too (publish_all_new_keys_reports_per_s),
and then one router's refresh, which then reads them all (what a router meets each
second when every replica is busy).

Figures:
- route_p50_us / route_p99_us: one `rank` call for a random known tenant.
- plan_ms: median `compute_plan` time inside `Controller.step` in steady state, with the
  per-replica plan slices it derives (`controlplane/plan_slices.py`).
- plan_write_ms: the fenced write (plan, usage, changed slices); fanout_ms: every
  replica's `PlanFollower.poll` (its slice and the heartbeat), all from this process;
  plan_parse_ms: parsing the whole plan once, what each replica paid per plan before.
- ingest_reports_per_s: reports per second through the publish -> Redis -> controller
  pipeline = its slower stage: publish (JSON encode + the publish script, batched here
  for all replicas, prefix keys included) or the controller's read (`read_s` of
  `Controller.step`: quota version check + one script call + validation; no prefix
  keys). Both stages run back to back in one process: ingest_one_process_reports_per_s.
- router_refresh_ms: one router's refresh (plan head, reports, then the prefix keys of
  every replica, all changed, and its prefix index updated).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import write_json

TARGETS = {"route_p99_us": 50.0, "plan_ms": 100.0, "ingest_reports_per_s": 20_000.0}
NEW_KEYS_PER_CYCLE = 4  # prefix keys a replica's cache gains (and loses) per write
KEYS_WRITTEN_EVERY = 10  # cycles: report period 0.1 s, prefix_keys_period_s 1 s


def cli(
    replicas: Annotated[int, typer.Option(help="Number of synthetic replicas.")] = 1000,
    tenants: Annotated[int, typer.Option(help="Number of tenants with quotas.")] = 10000,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the figures as JSON here.")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Use this Redis instead of starting a private one.")
    ] = None,
    routes: Annotated[int, typer.Option(help="Routing decisions to time.")] = 200_000,
    rounds: Annotated[int, typer.Option(help="Plan and ingest rounds to time.")] = 5,
    seed: Annotated[int, typer.Option(help="Seed for the synthetic workload.")] = 0,
) -> None:
    """Benchmark the control plane at cluster scale (figures go to bench/RESULTS.md)."""
    from controlplane.local_redis import LocalRedis

    if replicas < 1 or tenants < 1 or routes < 100 or rounds < 1:
        raise typer.BadParameter("need replicas, tenants, rounds >= 1 and routes >= 100")
    if redis_url is not None:
        figures = asyncio.run(_run(redis_url, replicas, tenants, routes, rounds, seed))
    else:
        with (
            tempfile.TemporaryDirectory(prefix="vtoken-bench-redis-") as directory,
            LocalRedis(Path(directory), persistent=False) as server,
        ):
            figures = asyncio.run(_run(server.url, replicas, tenants, routes, rounds, seed))
    for name, value in figures.items():
        typer.echo(f"{name:>28}: {value}")
    for name, target in TARGETS.items():
        met = figures[name] >= target if name.startswith("ingest") else figures[name] <= target
        typer.echo(
            f"target {name} {'>=' if name.startswith('ingest') else '<='} {target}: "
            f"{'met' if met else 'MISSED'}"
        )
    if json_path is not None:
        write_json(json_path, figures)


def _synthetic(replicas: int, tenants: int, now_s: float, rng: random.Random) -> tuple[Any, Any]:
    """Quotas and reports: each tenant holds KV on 1-2 replicas; Zipf-like demand."""
    from controlplane.models import ReplicaReport, TenantQuota, TenantUsage
    from controlplane.prefix import MAX_REPORTED_KEYS

    quotas = {
        f"tenant-{t}": TenantQuota(tenant_id=f"tenant-{t}", kv_budget_blocks=rng.randint(64, 4096))
        for t in range(tenants)
    }
    held: list[dict[str, TenantUsage]] = [{} for _ in range(replicas)]
    for t in range(tenants):
        blocks = max(1, int(400 / (1 + t % 500) ** 0.8))
        for _ in range(1 if rng.random() < 0.7 else 2):
            held[rng.randrange(replicas)][f"tenant-{t}"] = TenantUsage(
                blocks=blocks, live_tokens=blocks * 12, requests=1 + blocks // 64
            )
    reports = {}
    for r in range(replicas):
        total = 4096
        used = min(total, sum(u.blocks for u in held[r].values()))
        if used < sum(u.blocks for u in held[r].values()):
            held[r] = dict(list(held[r].items())[:8])
            used = sum(u.blocks for u in held[r].values())
        reports[f"replica-{r}"] = ReplicaReport(
            replica_id=f"replica-{r}",
            engine_id="vllm-0.32",
            model_id="synthetic",
            heartbeat_s=now_s,
            block_size=16,
            total_blocks=total,
            free_blocks=total - used,
            used_blocks=used,
            live_tokens=sum(u.live_tokens for u in held[r].values()),
            reclaimable_blocks=used // 5,
            queue_depth=rng.randint(0, 8),
            running_requests=sum(u.requests for u in held[r].values()),
            tenants=held[r],
            prefix_keys=_prefix_keys(r, 0, min(total, MAX_REPORTED_KEYS)),
        )
    return quotas, reports


def _prefix_keys(replica: int, cycle: int, count: int) -> tuple[str, ...]:
    """A replica's keys at `cycle`, most recent first: each cycle adds
    `NEW_KEYS_PER_CYCLE` new ones and forgets as many of the oldest."""
    newest = cycle * NEW_KEYS_PER_CYCLE + count
    return tuple(f"{replica:06x}{k:010x}" for k in range(newest - 1, newest - count - 1, -1))


async def _run(
    url: str, replicas: int, tenants: int, routes: int, rounds: int, seed: int
) -> dict[str, Any]:
    from controlplane.clock import SystemClock
    from controlplane.controller import Controller, ControllerConfig
    from controlplane.keys import KeySpace
    from controlplane.lease import ControllerLease
    from controlplane.redis_conn import RedisConfig, connect
    from controlplane.router import RouterConfig, RouterCore
    from controlplane.store import RedisStore

    rng = random.Random(seed)
    clock = SystemClock()
    client = connect(RedisConfig(url=url, socket_timeout_s=10.0))
    keys = KeySpace(prefix=f"bench-{seed}-{int(time.time())}")
    store = RedisStore(client, keys)
    quotas, reports = _synthetic(replicas, tenants, clock.now(), rng)
    await store.put_quotas(quotas.values())

    config = ControllerConfig(period_s=1.0, lease_ttl_s=30.0, report_max_age_s=60.0)
    controller = Controller(
        store, ControllerLease(client, "bench", config.lease_ttl_s, keys), clock, config
    )
    cycles = await _cycles(controller, store, reports, rounds + 1, clock)
    # Fresh reports for the router's load order; no controller runs during the timing,
    # so the plan must not age out (`max_plan_age_s`).
    await store.publish_reports(
        [r.model_copy(update={"heartbeat_s": clock.now()}) for r in reports.values()], 60.0
    )
    router = RouterCore(store, clock, RouterConfig(max_plan_age_s=3600.0))
    await router.refresh()
    route = _route(router, list(quotas), frozenset(reports), routes, rng)
    await client.delete(*(await client.keys(f"{keys.prefix}:*")))
    await client.aclose()
    return {"replicas": replicas, "tenants": tenants, **route, **cycles}


def _overloaded(report: Any) -> Any:
    """`report` with its largest tenant grown until the replica is 95% used."""
    from controlplane.models import TenantUsage

    if not report.tenants:
        return report
    tenant_id = max(report.tenants, key=lambda t: report.tenants[t].blocks)
    extra = max(0, int(0.95 * report.total_blocks) - report.used_blocks)
    usage = report.tenants[tenant_id]
    tenants = {
        **report.tenants,
        tenant_id: TenantUsage(
            blocks=usage.blocks + extra,
            live_tokens=usage.live_tokens + 12 * extra,
            requests=usage.requests,
        ),
    }
    return report.model_validate(
        {
            **report.model_dump(),
            "tenants": tenants,
            "used_blocks": report.used_blocks + extra,
            "free_blocks": report.free_blocks - extra,
            "live_tokens": report.live_tokens + 12 * extra,
        }
    )


async def _cycles(
    controller: Any, store: Any, reports: dict[str, Any], cycles: int, clock: Any
) -> dict[str, Any]:
    """Controller cycles as in production: every replica reports (one batched publish
    here, the same encoding and script as a replica's own write, its prefix keys changed
    since the last), then `step()` reads the reports, computes the plan and its slices
    and writes them; then every replica's plan follower polls its slice, and one router
    refreshes. The first cycle is cold (no plan); from the second on, 2% of the replicas
    turn hot each cycle so the plan moves tenants.
    """
    from controlplane.plan_follower import PlanFollower

    rng = random.Random(1)
    followers = [PlanFollower(store, replica_id, clock) for replica_id in reports]
    timings: dict[str, list[float]] = {"publish": [], "fanout": []}
    held_keys = {r: report.prefix_keys for r, report in reports.items()}
    results = []
    for cycle in range(cycles):
        current = dict(reports)
        if cycle > 0:
            for replica_id in rng.sample(sorted(reports), max(1, len(reports) // 50)):
                current[replica_id] = _overloaded(reports[replica_id])
        for i, replica_id in enumerate(reports):
            if i % KEYS_WRITTEN_EVERY == cycle % KEYS_WRITTEN_EVERY:
                held_keys[replica_id] = _prefix_keys(i, cycle, len(held_keys[replica_id]))
        now = clock.now()
        fresh = [
            r.model_copy(update={"heartbeat_s": now, "prefix_keys": held_keys[replica_id]})
            for replica_id, r in current.items()
        ]
        start = time.perf_counter()
        await store.publish_reports(fresh, ttl_s=60.0)
        timings["publish"].append(time.perf_counter() - start)
        result = await controller.step()
        assert result.leader and result.plan is not None
        assert len(result.plan.replica_ids) == len(reports), "reports lost in ingestion"
        results.append(result)
        start = time.perf_counter()
        await asyncio.gather(*(follower.poll() for follower in followers))
        timings["fanout"].append(time.perf_counter() - start)
        held = sum(1 for follower in followers if follower.allowance_now())
        assert held == sum(1 for a in result.plan.allowance.values() if a), "slices lost"
    steady = results[1:]
    count = len(reports)
    publish = statistics.median(timings["publish"][1:])
    read = statistics.median(r.read_s for r in steady)
    # Replicas publish from their own processes while the controller reads, so the
    # pipeline's throughput is its slower stage; both stages in one process, one after
    # the other, is reported too.
    return {
        "prefix_keys_per_report": len(next(iter(reports.values())).prefix_keys),
        "prefix_keys_written_fraction": 1 / KEYS_WRITTEN_EVERY,
        "plan_ms": round(statistics.median(r.plan_s for r in steady) * 1e3, 1),
        "plan_cold_ms": round(results[0].plan_s * 1e3, 1),
        "plan_write_ms": round(statistics.median(r.write_s for r in steady) * 1e3, 1),
        "controller_cycle_ms": round(
            statistics.median(r.read_s + r.plan_s + r.write_s for r in steady) * 1e3, 1
        ),
        "plan_moves_per_cycle": max(r.num_moves for r in steady),
        **await _slice_figures(store, [r.plan for r in results]),
        "fanout_ms": round(statistics.median(timings["fanout"][1:]) * 1e3, 1),
        **await _all_keys_changed(store, reports, clock, cycles),
        "ingest_reports_per_s": round(count / max(publish, read)),
        "publish_reports_per_s": round(count / publish),
        "read_reports_per_s": round(count / read),
        "ingest_one_process_reports_per_s": round(count / (publish + read)),
        **await _publish_one(store, next(iter(reports.values()))),
    }


async def _all_keys_changed(
    store: Any, reports: dict[str, Any], clock: Any, cycle: int
) -> dict[str, float]:
    """Every replica writes new prefix keys at once; then a router that read them all
    before refreshes and reads every one (median of 3)."""
    from controlplane.router import RouterConfig, RouterCore

    router = RouterCore(store, clock, RouterConfig(report_refresh_s=1e-6, report_max_age_s=60))
    assert await router.refresh()
    publish_s, refresh_s = [], []
    for turn in range(3):
        fresh = [
            r.model_copy(
                update={
                    "heartbeat_s": clock.now(),
                    "prefix_keys": _prefix_keys(i, cycle + turn, len(r.prefix_keys)),
                }
            )
            for i, r in enumerate(reports.values())
        ]
        start = time.perf_counter()
        await store.publish_reports(fresh, ttl_s=60.0)
        publish_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert await router.refresh()
        refresh_s.append(time.perf_counter() - start)
    return {
        "publish_all_new_keys_reports_per_s": round(len(reports) / statistics.median(publish_s)),
        "router_refresh_ms": round(statistics.median(refresh_s) * 1e3, 1),
    }


async def _slice_figures(store: Any, plans: list[Any]) -> dict[str, Any]:
    """Sizes of the whole plan and of the slices, slices rewritten per cycle, and the
    time to parse the whole plan (what each replica paid per plan before slices)."""
    from controlplane.models import RoutingPlan
    from controlplane.plan_slices import slice_update

    raw_plan = plans[-1].model_dump_json()
    parse_s = []
    for _ in range(3):
        start = time.perf_counter()
        RoutingPlan.model_validate_json(raw_plan)
        parse_s.append(time.perf_counter() - start)
    slices = await store.redis.hvals(store.keys.plan_slices)
    written = [len(slice_update(p, q).upserts) for q, p in zip(plans, plans[1:], strict=False)]
    return {
        "plan_json_bytes": len(raw_plan),
        "plan_parse_ms": round(statistics.median(parse_s) * 1e3, 1),
        "slice_bytes_median": statistics.median(len(s) for s in slices),
        "slice_bytes_max": max(len(s) for s in slices),
        "slices_written_per_cycle": max(written),
    }


async def _publish_one(store: Any, sample: Any) -> dict[str, float]:
    """One replica's own write, p50 of 200 round trips: with its prefix keys unchanged,
    and with new ones each time."""
    same, new = [], []
    for _ in range(200):
        start = time.perf_counter()
        await store.publish_report(sample, ttl_s=60.0)
        same.append(time.perf_counter() - start)
    for i in range(200):
        keys = _prefix_keys(0, 1000 + i, len(sample.prefix_keys))
        moved = sample.model_copy(update={"prefix_keys": keys})
        start = time.perf_counter()
        await store.publish_report(moved, ttl_s=60.0)
        new.append(time.perf_counter() - start)
    return {
        "publish_one_p50_us": round(statistics.median(same) * 1e6, 1),
        "publish_one_new_keys_p50_us": round(statistics.median(new) * 1e6, 1),
    }


def _route(
    router: Any, tenant_ids: list[str], candidates: frozenset[str], routes: int, rng: random.Random
) -> dict[str, Any]:
    import gc

    picks = [rng.choice(tenant_ids) for _ in range(routes)]
    rank = router.rank
    for tenant_id in picks[:1000]:  # warm up
        rank(tenant_id, candidates)
    samples = [0] * routes
    clock_ns = time.perf_counter_ns
    sources: dict[str, int] = {}
    gc.collect()
    for i, tenant_id in enumerate(picks):
        start = clock_ns()
        ranking = rank(tenant_id, candidates)
        samples[i] = clock_ns() - start
        sources[ranking.source.value] = sources.get(ranking.source.value, 0) + 1
    samples.sort()
    fallback = [0] * (routes // 10)  # tenants the plan does not know: least-loaded rank
    for i in range(len(fallback)):
        start = clock_ns()
        rank("unknown-tenant", candidates)
        fallback[i] = clock_ns() - start
    fallback.sort()
    return {
        "route_p50_us": round(samples[routes // 2] / 1e3, 2),
        "route_p99_us": round(samples[int(routes * 0.99)] / 1e3, 2),
        "route_max_us": round(samples[-1] / 1e3, 1),
        "route_sources": sources,
        "route_fallback_p99_us": round(fallback[int(len(fallback) * 0.99)] / 1e3, 2),
    }
