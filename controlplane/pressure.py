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
    warm: Mapping[str, Mapping[str, float]],
) -> dict[str, dict[str, int]]:
    """`allowance[replica_id][tenant_id]`: the most blocks a tenant may hold on a replica.

    Within budget, each replica keeps what the tenant holds there and the slack (budget -
    held everywhere) is shared over its warm set by routing weight (`warm[tenant][replica]`,
    weights summing to 1), so a replica about to receive its new requests has room for
    them and one that holds nothing and gets none has 0. Over budget, each replica gets
    `held there x budget / held everywhere`, which the replica takes back at its next step
    by evicting the tenant's requests to their budgets (deeper than that is `pressure`'s).
    Either way the shares sum to at most the budget. A tenant with no quota (deleted) has
    no limit; its requests drain on their own."""
    held: dict[str, dict[str, int]] = {}
    for replica_id, report in reports.items():
        for tenant_id, tenant in report.tenants.items():
            if tenant.blocks:
                held.setdefault(tenant_id, {})[replica_id] = tenant.blocks
    allowance: dict[str, dict[str, int]] = {}
    for tenant_id, quota in quotas.items():
        mine, weights = held.get(tenant_id, {}), warm.get(tenant_id, {})
        budget, total = quota.kv_budget_blocks, usage.get(tenant_id, 0)
        for replica_id in (mine.keys() | weights.keys()) & reports.keys():
            here = mine.get(replica_id, 0)
            if total > budget:
                share = here * budget // total
            else:
                share = here + int((budget - total) * weights.get(replica_id, 0.0))
            allowance.setdefault(replica_id, {})[tenant_id] = share
    return allowance
