"""``GET /admin/status`` and ``vtoken status``: replicas, tenants, KV held vs quota.

Per tenant: its budget (``quota_blocks``), active KV (``kv_blocks``: what its running
requests hold, summed over fresh reports; a prefix-cache block shared by several requests
is charged once, to its earliest current holder), ``shared_blocks`` (blocks its requests
hold that another request pays for), ``floor_blocks`` (what eviction to their
budgets would bring them to; admission charges this), ``reclaimable_blocks`` (the
difference), its warm set in the current plan, and the plan's eviction pressure on it
(replica id -> keep fraction; empty while it is within budget)."""

from __future__ import annotations

import time
from typing import Any

from controlplane.metrics_endpoint import KEEP_TARGET_S
from controlplane.store import RedisStore, ReportSnapshot

REPORT_MAX_AGE_S = 3.0
_SUMMED = ("blocks", "floor_blocks", "requests", "live_tokens", "shared_blocks")


async def cluster_status(store: RedisStore, now_s: float | None = None) -> dict[str, Any]:
    """A JSON-ready snapshot assembled from the replicas' latest reports and the quotas."""
    now_s = time.time() if now_s is None else now_s
    snapshot = await store.read_reports(now_s, REPORT_MAX_AGE_S, forget_after_s=3600.0)
    quotas = await store.list_quotas()
    plan = await store.read_plan()
    head = await store.read_plan_head()
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
    held: dict[str, dict[str, int]] = {}
    for report in snapshot.fresh.values():
        for tenant_id, usage in report.tenants.items():
            entry = held.setdefault(tenant_id, dict.fromkeys(_SUMMED, 0))
            for name in _SUMMED:
                entry[name] += getattr(usage, name)
    tenants = []
    for tenant_id, quota in sorted(quotas.items()):
        sums = held.get(tenant_id, {})
        route = plan.tenants.get(tenant_id) if plan else None
        pressure = {
            replica_id: by_tenant[tenant_id].keep_fraction
            for replica_id, by_tenant in (plan.pressure.items() if plan else ())
            if tenant_id in by_tenant
        }
        blocks, floor = sums.get("blocks", 0), sums.get("floor_blocks", 0)
        tenants.append(
            {
                "id": tenant_id,
                "quota_blocks": quota.kv_budget_blocks,
                "kv_blocks": blocks,
                "floor_blocks": floor,
                "reclaimable_blocks": max(0, blocks - floor),
                "running_requests": sums.get("requests", 0),
                "live_tokens": sums.get("live_tokens", 0),
                "shared_blocks": sums.get("shared_blocks", 0),
                "over_budget": bool(route and route.over_budget),
                "replicas": [w.replica_id for w in route.replicas] if route else [],
                "pressure": pressure,
            }
        )
    return {
        "plan_version": plan.version if plan else None,
        "plan_heartbeat_s": head.heartbeat_s,  # moves every controller cycle
        "replicas": replicas,
        "tenants": tenants,
        "blocks_reclaimed": sum(r.get("blocks_reclaimed", 0) for r in replicas),
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
