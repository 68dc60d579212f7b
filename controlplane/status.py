"""``GET /admin/status`` and ``vtoken status``: replicas, tenants, KV held vs quota."""

from __future__ import annotations

import time
from typing import Any

from controlplane.store import RedisStore

REPORT_MAX_AGE_S = 3.0


async def cluster_status(store: RedisStore, now_s: float | None = None) -> dict[str, Any]:
    """A JSON-ready snapshot assembled from the replicas' latest reports and the quotas."""
    now_s = time.time() if now_s is None else now_s
    snapshot = await store.read_reports(now_s, REPORT_MAX_AGE_S, forget_after_s=3600.0)
    quotas = await store.list_quotas()
    plan = await store.read_plan()
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
        }
        for replica_id, report in sorted(snapshot.fresh.items())
    ]
    replicas += [{"id": replica_id, "fresh": False} for replica_id in sorted(snapshot.stale_ids)]
    held: dict[str, dict[str, int]] = {}
    for report in snapshot.fresh.values():
        for tenant_id, usage in report.tenants.items():
            entry = held.setdefault(
                tenant_id, {"blocks": 0, "floor_blocks": 0, "requests": 0, "live_tokens": 0}
            )
            entry["blocks"] += usage.blocks
            entry["floor_blocks"] += usage.floor_blocks
            entry["requests"] += usage.requests
            entry["live_tokens"] += usage.live_tokens
    tenants = [
        {
            "id": tenant_id,
            "quota_blocks": quota.kv_budget_blocks,
            "kv_blocks": held.get(tenant_id, {}).get("blocks", 0),
            "floor_blocks": held.get(tenant_id, {}).get("floor_blocks", 0),
            "running_requests": held.get(tenant_id, {}).get("requests", 0),
            "live_tokens": held.get(tenant_id, {}).get("live_tokens", 0),
            "over_budget": bool(
                plan and tenant_id in plan.tenants and plan.tenants[tenant_id].over_budget
            ),
        }
        for tenant_id, quota in sorted(quotas.items())
    ]
    return {
        "plan_version": plan.version if plan else None,
        "replicas": replicas,
        "tenants": tenants,
        "blocks_reclaimed": sum(r.get("blocks_reclaimed", 0) for r in replicas),
    }
