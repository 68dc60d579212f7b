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


MIN_KEEP_FRACTION = 0.01
"""The least keep fraction pressure asks for: a tenant whose sliding-window blocks alone
pass its budget keeps what its policy protects (the engine never evicts below that)."""


def tenant_window_blocks(reports: Mapping[str, ReplicaReport]) -> dict[str, int]:
    """Sliding-window blocks per tenant summed over the given reports (tenants with 0
    omitted): the part of their usage no eviction gives back (hybrid models)."""
    windows: dict[str, int] = {}
    for report in reports.values():
        for tenant_id, tenant in report.tenants.items():
            if tenant.window_blocks:
                windows[tenant_id] = windows.get(tenant_id, 0) + tenant.window_blocks
    return windows


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
    requests drain on their own.

    On a hybrid model the engine evicts from the full-attention group only, never from
    the sliding-window groups (`TenantUsage.window_blocks`, `W` in all): the fraction is of
    what it can evict, `((1 - headroom) * budget - W) / (usage - W)`, at least
    `MIN_KEEP_FRACTION` (a tenant holding windows only gets none); `target_blocks` counts
    the windows kept whole."""
    windows = tenant_window_blocks(reports)
    keep: dict[str, float] = {}
    for tenant_id, blocks in usage.items():
        quota = quotas.get(tenant_id)
        if quota is not None and blocks > quota.kv_budget_blocks:
            window = windows.get(tenant_id, 0)
            if window == 0:  # every block evictable: as for any model without windows
                keep[tenant_id] = (1.0 - headroom) * quota.kv_budget_blocks / blocks
            elif blocks > window:
                target = (1.0 - headroom) * quota.kv_budget_blocks - window
                keep[tenant_id] = max(MIN_KEEP_FRACTION, target / (blocks - window))
            # else: only sliding-window blocks, which no eviction gives back
    pressure: dict[str, dict[str, dict[str, float | int]]] = {}
    if not keep:
        return pressure
    for replica_id, report in reports.items():
        for tenant_id, tenant in report.tenants.items():
            fraction = keep.get(tenant_id)
            evictable = tenant.blocks - tenant.window_blocks
            if fraction is None or evictable == 0:
                continue
            pressure.setdefault(replica_id, {})[tenant_id] = {
                "keep_fraction": fraction,
                "target_blocks": tenant.window_blocks + int(evictable * fraction),
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
    no limit; its requests drain on their own.

    On a hybrid model each share is sent less the tenant's sliding-window blocks on that
    replica (`TenantUsage.window_blocks`, at least 0): the engine holds a tenant's
    full-attention blocks to its allowance, the only ones it can evict."""
    held: dict[str, dict[str, int]] = {}
    windows: dict[tuple[str, str], int] = {}
    for replica_id, report in reports.items():
        for tenant_id, tenant in report.tenants.items():
            if tenant.blocks:
                held.setdefault(tenant_id, {})[replica_id] = tenant.blocks
            if tenant.window_blocks:
                windows[replica_id, tenant_id] = tenant.window_blocks
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
            window = windows.get((replica_id, tenant_id), 0)
            allowance.setdefault(replica_id, {})[tenant_id] = max(0, share - window)
    return allowance
