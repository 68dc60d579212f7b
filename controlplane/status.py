"""``GET /admin/status`` and ``vtoken status``: replicas, tenants, KV held vs quota.

Per tenant: its budget (``quota_blocks``), active KV (``kv_blocks``: what its running
requests hold, summed over fresh reports; a prefix-cache block shared by several requests
is charged once, to its earliest current holder), ``shared_blocks`` (blocks its requests
hold that another request pays for), ``floor_blocks`` (what eviction to their
budgets would bring them to; admission charges this), ``reclaimable_blocks`` (the
difference), ``window_blocks`` (of a model with sliding-window layers: the part of its
active KV in sliding-window groups, which eviction leaves to vLLM), its warm set in the
current plan, and the plan's eviction pressure on it (replica id -> keep fraction; empty
while it is within budget), and its requests waiting for admission at the ingresses
(``queue_depth``, ``queue_oldest_wait_s``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from controlplane.fair_queue import FairQueue, TenantQueue
from controlplane.metrics_endpoint import KEEP_TARGET_S
from controlplane.report_rows import ReportRows, ReportSnapshot, parse_reports
from controlplane.store import PlanHead, RedisStore, parse_plan, parse_quotas

REPORT_MAX_AGE_S = 3.0
_SUMMED = ("blocks", "floor_blocks", "window_blocks", "requests", "live_tokens", "shared_blocks")


async def cluster_status(
    store: RedisStore, now_s: float | None = None, queue: FairQueue | None = None
) -> dict[str, Any]:
    """A JSON-ready snapshot assembled from the replicas' latest reports and the quotas,
    with each tenant's requests waiting in ``queue`` (cluster-wide: ``queue_depth``,
    ``queue_oldest_wait_s``; 0 without a queue).

    Only the reads await on the event loop; parsing them and assembling the snapshot
    (~0.3 s at 1,000 replicas x 10,000 tenants, a 1.5 MB plan) run in a worker thread.
    Reports are read without their prefix keys."""
    now_s = time.time() if now_s is None else now_s
    rows = await store.read_report_rows(now_s, forget_after_s=3600.0)
    raw_quotas = await store.read_raw_quotas()
    raw_plan = await store.read_raw_plan()
    head = await store.read_plan_head()
    queues = await queue.queues() if queue is not None else {}
    return await asyncio.to_thread(_assemble, rows, raw_quotas, raw_plan, head, queues)


def _assemble(
    rows: ReportRows,
    raw_quotas: dict[str, str],
    raw_plan: str | None,
    head: PlanHead,
    queues: dict[str, TenantQueue],
) -> dict[str, Any]:
    snapshot = parse_reports(rows, REPORT_MAX_AGE_S)
    quotas = parse_quotas(raw_quotas)
    plan = parse_plan(raw_plan)
    replicas = _replica_rows(snapshot)
    held = _held(snapshot)
    counters = _virtual_counters(snapshot)
    pressure_on: dict[str, dict[str, float]] = {}  # tenant -> replica -> keep fraction
    for replica_id, by_tenant in sorted(plan.pressure.items()) if plan else ():
        for tenant_id, pressure in by_tenant.items():
            pressure_on.setdefault(tenant_id, {})[replica_id] = pressure.keep_fraction
    tenants = []
    for tenant_id, quota in sorted(quotas.items()):
        sums = held.get(tenant_id, {})
        route = plan.tenants.get(tenant_id) if plan else None
        blocks, floor = sums.get("blocks", 0), sums.get("floor_blocks", 0)
        waiting = queues.get(tenant_id)
        tenants.append(
            {
                "id": tenant_id,
                "quota_blocks": quota.kv_budget_blocks,
                "kv_blocks": blocks,
                "floor_blocks": floor,
                "window_blocks": sums.get("window_blocks", 0),  # sliding-window groups'
                "reclaimable_blocks": max(0, blocks - floor),
                "running_requests": sums.get("requests", 0),
                "live_tokens": sums.get("live_tokens", 0),
                "shared_blocks": sums.get("shared_blocks", 0),
                "over_budget": bool(route and route.over_budget),
                "replicas": [w.replica_id for w in route.replicas] if route else [],
                "pressure": pressure_on.get(tenant_id, {}),
                "queue_depth": waiting.depth if waiting else 0,
                "queue_oldest_wait_s": round(waiting.oldest_wait_s, 3) if waiting else 0.0,
                **_fairness(counters.get(tenant_id, {})),
            }
        )
    return {
        "plan_version": plan.version if plan else None,
        "plan_heartbeat_s": head.heartbeat_s,  # moves every controller cycle
        "replicas": replicas,
        "tenants": tenants,
        "blocks_reclaimed": sum(r.get("blocks_reclaimed", 0) for r in replicas),
    }


def _replica_rows(snapshot: ReportSnapshot) -> list[dict[str, Any]]:
    replicas = [
        {
            "id": replica_id,
            "fresh": True,
            "blocks_total": report.total_blocks,
            "blocks_used": report.used_blocks,
            "blocks_free": report.free_blocks,
            "reclaimable_blocks": report.reclaimable_blocks,
            "blocks_reclaimed": report.blocks_reclaimed,
            "naive_equivalent_blocks": report.naive_equivalent_blocks,
            "live_tokens": report.live_tokens,
            "running_requests": report.running_requests,
            "queue_depth": report.queue_depth,
            "preemptions": report.preemptions,
            "evictions_under_pressure": report.evictions_under_pressure,
            "evictions_to_bound": report.evictions_to_bound,
            "evictions_below_budget": report.evictions_below_budget,
            "max_step_s": round(report.max_step_s, 3),
            "repack_bytes": report.repack_bytes,
            "repack_seconds": round(report.repack_seconds, 3),
            "metrics_address": report.metrics_address,
            "report_age_s": _report_age(snapshot, replica_id),
        }
        for replica_id, report in sorted(snapshot.fresh.items())
    ]
    # Registered but silent (a lost node, a hung engine): listed, not fresh, with the age of
    # their last report, never dropped from the view while the registry remembers them.
    replicas += [
        {"id": replica_id, "fresh": False, "report_age_s": _report_age(snapshot, replica_id)}
        for replica_id in sorted(snapshot.stale_ids)
    ]
    return replicas


def _held(snapshot: ReportSnapshot) -> dict[str, dict[str, int]]:
    """Tenant -> its usage summed over the fresh reports."""
    held: dict[str, dict[str, int]] = {}
    for report in snapshot.fresh.values():
        for tenant_id, usage in report.tenants.items():
            entry = held.setdefault(tenant_id, dict.fromkeys(_SUMMED, 0))
            for name in _SUMMED:
                entry[name] += getattr(usage, name)
    return held


def _virtual_counters(snapshot: ReportSnapshot) -> dict[str, dict[str, tuple[float, float]]]:
    """Tenant -> replica -> (its virtual counter there, that counter less the smallest one
    among the tenants present on the replica, holding requests there; all reported when
    none is): the engines' fair order (``EngineCounters.tenant_counters``). A long-idle
    tenant's counter stays low and would make every present tenant look ahead."""
    counters: dict[str, dict[str, tuple[float, float]]] = {}
    for replica_id, report in sorted(snapshot.fresh.items()):
        if not report.tenant_counters:
            continue  # fairness off there
        present = [
            counter
            for tenant_id, counter in report.tenant_counters.items()
            if (usage := report.tenants.get(tenant_id)) and (usage.requests or usage.blocks)
        ]
        least = min(present or report.tenant_counters.values())
        for tenant_id, counter in report.tenant_counters.items():
            counters.setdefault(tenant_id, {})[replica_id] = (counter, counter - least)
    return counters


def _fairness(on_replicas: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """A tenant's ``virtual_counters`` per replica and its ``virtual_lead``: how many weighted
    tokens it is ahead of the replica's least-served tenant, on the replica where it is
    furthest ahead (0: served first everywhere; ``None``: no engine orders it)."""
    return {
        "virtual_counters": {r: round(counter, 1) for r, (counter, _) in on_replicas.items()},
        "virtual_lead": round(max(lead for _, lead in on_replicas.values()), 1)
        if on_replicas
        else None,
    }


def _report_age(snapshot: ReportSnapshot, replica_id: str) -> float | None:
    heartbeat = snapshot.last_heartbeat_s.get(replica_id)
    return None if heartbeat is None else round(max(0.0, snapshot.now_s - heartbeat), 2)


async def prometheus_targets(store: RedisStore, now_s: float | None = None) -> list[dict[str, Any]]:
    """The replicas' Prometheus endpoints in Prometheus' HTTP service discovery format
    (``http_sd_configs``): one group per replica that serves one and reported within
    :data:`controlplane.metrics_endpoint.KEEP_TARGET_S` (a replica inside a long step, or
    just lost, stays a target: Prometheus shows it down rather than losing it), labelled
    with its model id (its series carry the replica id themselves)."""
    now_s = time.time() if now_s is None else now_s
    targets = await store.read_metrics_targets(now_s, KEEP_TARGET_S)
    return [
        {"targets": [address], "labels": {"vtoken_model_id": model_id}}
        for _, (address, model_id) in sorted(targets.items())
    ]
