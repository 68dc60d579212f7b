"""Per-tenant usage across the cluster and eviction pressure for over-budget tenants."""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.models import ReplicaReport, TenantQuota


def tenant_usage_blocks(reports: Mapping[str, ReplicaReport]) -> dict[str, int]:
    """Live KV blocks per tenant summed over the given reports (tenants with 0 omitted)."""
    usage: dict[str, int] = {}
    for report in reports.values():
        for tenant_id, tenant in report.tenants.items():
            if tenant.blocks:
                usage[tenant_id] = usage.get(tenant_id, 0) + tenant.blocks
    return usage


HEADROOM = 0.1
"""A squeezed tenant is brought to (1 - HEADROOM) of its budget, not to the budget itself:
once the pressure is released its requests grow again (a token per step each), and the
headroom keeps that growth under the budget for a while instead of crossing it again at
the next step."""


def eviction_pressure(
    reports: Mapping[str, ReplicaReport],
    quotas: Mapping[str, TenantQuota],
    usage: Mapping[str, int],
    headroom: float = HEADROOM,
) -> dict[str, dict[str, dict[str, float | int]]]:
    """`pressure[replica_id][tenant_id]` (plain `EvictionPressure` data) for every tenant
    whose cluster-wide usage exceeds its `kv_budget_blocks`: each replica should keep
    `(1 - headroom) * budget / usage` of the tenant's blocks there, so the tenant's total
    shrinks back under its budget. Tenants without a quota (deleted) get no pressure; their
    requests drain on their own."""
    keep: dict[str, float] = {}
    for tenant_id, blocks in usage.items():
        quota = quotas.get(tenant_id)
        if quota is not None and blocks > quota.kv_budget_blocks:
            keep[tenant_id] = (1.0 - headroom) * quota.kv_budget_blocks / blocks
    pressure: dict[str, dict[str, dict[str, float | int]]] = {}
    if not keep:
        return pressure
    for replica_id, report in reports.items():
        for tenant_id, tenant in report.tenants.items():
            fraction = keep.get(tenant_id)
            if fraction is None or tenant.blocks == 0:
                continue
            pressure.setdefault(replica_id, {})[tenant_id] = {
                "keep_fraction": fraction,
                "target_blocks": int(tenant.blocks * fraction),
            }
    return pressure


def kv_allowance(
    reports: Mapping[str, ReplicaReport],
    quotas: Mapping[str, TenantQuota],
    usage: Mapping[str, int],
) -> dict[str, dict[str, int]]:
    """`allowance[replica_id][tenant_id]`: the blocks a tenant may hold on each replica
    where it holds any, `floor(held there * budget / held everywhere)`. The shares sum to
    at most the budget, and a tenant under budget gets room to grow in proportion; one
    over budget gets less than it holds, which the replica takes back at its next step by
    evicting the tenant's requests to their budgets (deeper than that is `pressure`'s)."""
    allowance: dict[str, dict[str, int]] = {}
    for replica_id, report in reports.items():
        for tenant_id, tenant in report.tenants.items():
            quota, total = quotas.get(tenant_id), usage.get(tenant_id, 0)
            if quota is None or tenant.blocks == 0 or total == 0:
                continue
            share = tenant.blocks * quota.kv_budget_blocks // total
            allowance.setdefault(replica_id, {})[tenant_id] = share
    return allowance
