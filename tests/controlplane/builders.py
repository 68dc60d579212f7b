"""Small builders for valid models, so tests state only what matters to them."""

from __future__ import annotations

from controlplane.models import ReplicaReport, TenantQuota, TenantUsage


def quota(tenant_id: str, budget: int = 100, **fields: object) -> TenantQuota:
    return TenantQuota.model_validate(
        {"tenant_id": tenant_id, "kv_budget_blocks": budget, **fields}
    )


def report(
    replica_id: str,
    heartbeat_s: float,
    tenants: dict[str, int] | None = None,
    total_blocks: int = 100,
    extra_used: int = 0,
    reclaimable: int = 0,
    queue_depth: int = 0,
    draining: bool = False,
    floors: dict[str, int] | None = None,
    prefix_keys: tuple[str, ...] = (),
    windows: dict[str, int] | None = None,
) -> ReplicaReport:
    """A consistent report: used = the tenants' blocks + `extra_used`; a tenant's floor is
    what it holds unless `floors` says less; `windows`: of its blocks, those its
    sliding-window groups hold (a hybrid model)."""
    floors, windows = floors or {}, windows or {}
    usage = {
        t: TenantUsage(
            blocks=b,
            floor_blocks=floors.get(t, b),
            live_tokens=b * 16,
            requests=1,
            window_blocks=windows.get(t, 0),
        )
        for t, b in (tenants or {}).items()
    }
    used = sum(u.blocks for u in usage.values()) + extra_used
    return ReplicaReport(
        prefix_keys=prefix_keys,
        replica_id=replica_id,
        heartbeat_s=heartbeat_s,
        block_size=16,
        total_blocks=total_blocks,
        free_blocks=total_blocks - used,
        used_blocks=used,
        reclaimable_blocks=reclaimable,
        live_tokens=used * 16,
        queue_depth=queue_depth,
        draining=draining,
        tenants=usage,
    )
