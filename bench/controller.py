"""`vtoken bench controller`: routing latency, plan time and report ingestion at scale.

Synthetic replica reports and tenant quotas go through the same code path as production:
`RedisStore.publish_reports` / `read_reports` against a real redis-server (started here
unless `--redis-url` is given), `Controller.step` and `compute_plan` for the plan, and
`RouterCore.rank` for routing decisions (in process, candidates = every replica).

Figures:
- route_p50_us / route_p99_us: one `rank` call for a random known tenant.
- plan_ms: median `compute_plan` time inside `Controller.step` in steady state.
- ingest_reports_per_s: reports per second through the publish -> Redis -> controller
  pipeline = its slower stage: publish (JSON encode + the publish script, batched here
  for all replicas) or the controller's read (`read_s` of `Controller.step`: quota
  version check + one script call + validation). Both stages run back to back in one
  process: ingest_one_process_reports_per_s.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import write_json

TARGETS = {"route_p99_us": 50.0, "plan_ms": 200.0, "ingest_reports_per_s": 20_000.0}


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
    import asyncio

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
        )
    return quotas, reports


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
    here, the same encoding and script as a replica's own write), then `step()` reads
    the reports, computes the plan and writes it. The first cycle is cold (no plan);
    from the second on, 2% of the replicas turn hot each cycle so the plan moves tenants.
    """
    rng = random.Random(1)
    publish_s, results = [], []
    for cycle in range(cycles):
        now = clock.now()
        current = dict(reports)
        if cycle > 0:
            for replica_id in rng.sample(sorted(reports), max(1, len(reports) // 50)):
                current[replica_id] = _overloaded(reports[replica_id])
        fresh = [r.model_copy(update={"heartbeat_s": now}) for r in current.values()]
        start = time.perf_counter()
        await store.publish_reports(fresh, ttl_s=60.0)
        publish_s.append(time.perf_counter() - start)
        result = await controller.step()
        assert result.leader and result.plan is not None
        assert len(result.plan.replica_ids) == len(reports), "reports lost in ingestion"
        results.append(result)
    steady = results[1:]
    one = []
    sample = next(iter(reports.values()))
    for _ in range(200):  # one replica's own write: one round trip
        start = time.perf_counter()
        await store.publish_report(sample, ttl_s=60.0)
        one.append(time.perf_counter() - start)
    count = len(reports)
    publish = statistics.median(publish_s[1:])
    read = statistics.median(r.read_s for r in steady)
    # Replicas publish from their own processes while the controller reads, so the
    # pipeline's throughput is its slower stage; both stages in one process, one after
    # the other, is reported too.
    return {
        "plan_ms": round(statistics.median(r.plan_s for r in steady) * 1e3, 1),
        "plan_cold_ms": round(results[0].plan_s * 1e3, 1),
        "controller_cycle_ms": round(
            statistics.median(r.read_s + r.plan_s + r.write_s for r in steady) * 1e3, 1
        ),
        "plan_moves_per_cycle": max(r.num_moves for r in steady),
        "plan_json_bytes": len(results[-1].plan.model_dump_json()),
        "ingest_reports_per_s": round(count / max(publish, read)),
        "publish_reports_per_s": round(count / publish),
        "read_reports_per_s": round(count / read),
        "ingest_one_process_reports_per_s": round(count / (publish + read)),
        "publish_one_p50_us": round(statistics.median(one) * 1e6, 1),
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
