"""The routing plan: which replicas serve each tenant, recomputed every controller period.

Pure and synchronous (no I/O): `compute_plan(inputs, config)`.

Load model. A replica's projected load is its ideal KV use (`total - free - reclaimable`)
minus the blocks of tenants no longer routed to it (they drain away) plus the demand of
tenants newly placed on it this round. Utilisation is load / total blocks.

Rules, in order (CacheRoute's planned warm sets, seed 004):
1. Keep every tenant on the live replicas it had (prefix reuse); stale or draining
   replicas drop out of every set.
2. Relief: a replica above `high_watermark` sheds its largest tenants until it is at or
   below `low_watermark`: a tenant with other replicas just loses this one; a single-home
   tenant moves to the least-utilised replica that stays at or below `low_watermark`
   after taking it. Nothing moves unless a replica is above the high mark, and a move
   never pushes its target above the low mark, so plans do not flap (hysteresis).
3. Warm-set size: a tenant whose demand per replica exceeds `hot_tenant_fraction` of a
   mean replica gets another replica (up to `max_replicas_per_tenant`); a set shrinks only
   when demand falls below half of that. Tenants with no live replica are placed on the
   least-utilised one.
4. Weights within a set are proportional to each replica's remaining headroom.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.models import ReplicaReport, RoutingPlan, TenantQuota
from controlplane.pressure import eviction_pressure, kv_allowance, tenant_usage_blocks


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    hot_tenant_fraction: float = 0.25
    max_replicas_per_tenant: int = 4
    min_demand_blocks: int = 1
    min_weight_headroom: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark < high_watermark <= 1")
        if not 0 < self.hot_tenant_fraction <= 1:
            raise ValueError("hot_tenant_fraction must be in (0, 1]")
        if self.max_replicas_per_tenant < 1 or self.min_demand_blocks < 1:
            raise ValueError("max_replicas_per_tenant and min_demand_blocks must be >= 1")


@dataclass(frozen=True, slots=True)
class PlanInputs:
    version: int
    fence: int
    now_s: float
    reports: Mapping[str, ReplicaReport]  # fresh reports only
    stale_ids: frozenset[str]
    quotas: Mapping[str, TenantQuota]
    previous: RoutingPlan | None


@dataclass(frozen=True, slots=True)
class PlanResult:
    plan: RoutingPlan
    usage_blocks: dict[str, int]  # per tenant, cluster-wide, at floors; admission reads it
    num_moves: int  # tenants whose replica set changed


class _Loads:
    """Projected load per live replica with a lazy min-heap on utilisation."""

    def __init__(self, capacity: dict[str, int], load: dict[str, float]) -> None:
        self.capacity = capacity
        self.load = load
        self._heap = [(load[r] / capacity[r], r) for r in capacity]
        heapq.heapify(self._heap)

    def utilisation(self, replica_id: str) -> float:
        return self.load[replica_id] / self.capacity[replica_id]

    def add(self, replica_id: str, blocks: float) -> None:
        self.load[replica_id] = max(0.0, self.load[replica_id] + blocks)
        heapq.heappush(self._heap, (self.utilisation(replica_id), replica_id))

    def least_utilised(self, exclude: list[str]) -> str | None:
        """The live replica with the lowest projected utilisation, not in `exclude`."""
        skipped: list[tuple[float, str]] = []
        found: str | None = None
        while self._heap:
            util, replica_id = self._heap[0]
            if util != self.utilisation(replica_id):
                heapq.heappop(self._heap)  # outdated entry
                continue
            if replica_id in exclude:
                skipped.append(heapq.heappop(self._heap))
                continue
            found = replica_id
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found


def compute_plan(inputs: PlanInputs, config: PlannerConfig) -> PlanResult:
    """The next plan from fresh reports, quotas and the previous plan."""
    reports = inputs.reports
    live = {r: rep for r, rep in reports.items() if not rep.draining}
    drained = sorted(inputs.stale_ids | {r for r, rep in reports.items() if rep.draining})
    usage = tenant_usage_blocks(reports)
    previous = inputs.previous.tenants if inputs.previous is not None else {}
    routes: dict[str, list[str]] = {}
    before: dict[str, tuple[str, ...]] = {}
    for tenant_id in inputs.quotas:
        route = previous.get(tenant_id)
        if route is not None:
            before[tenant_id] = tuple(w.replica_id for w in route.replicas)
            routes[tenant_id] = [r for r in before[tenant_id] if r in live]
    if live:
        loads = _initial_loads(live, routes)
        _relieve(live, routes, loads, config)
        _size_warm_sets(inputs.quotas, usage, routes, loads, config)
        tenants = _tenant_routes(inputs.quotas, usage, routes, loads, config)
    else:
        tenants = {}
    num_moves = sum(1 for t, ids in before.items() if ids != tuple(routes.get(t, ())))
    # One validation of plain data in pydantic's Rust core: 3x faster than building
    # 20000 models in Python (~30 vs ~80 ms at 10000 tenants), and checked.
    plan = RoutingPlan.model_validate(
        {
            "version": inputs.version,
            "fence": inputs.fence,
            "created_s": inputs.now_s,
            "replica_ids": sorted(live),
            "drained_replica_ids": drained,
            "tenants": tenants,
            "pressure": eviction_pressure(reports, inputs.quotas, usage),
            "allowance": kv_allowance(reports, inputs.quotas, usage, _weights(tenants)),
        }
    )
    return PlanResult(plan, committed_blocks(reports), num_moves)


def _weights(tenants: Mapping[str, dict[str, object]]) -> dict[str, dict[str, float]]:
    """tenant -> replica -> routing weight, from the plain routes of `_tenant_routes`."""
    return {
        tenant_id: {w["replica_id"]: w["weight"] for w in route["replicas"]}  # type: ignore[attr-defined]
        for tenant_id, route in tenants.items()
    }


def committed_blocks(reports: Mapping[str, ReplicaReport]) -> dict[str, int]:
    """What each tenant's running requests count against its budget, cluster-wide: their
    floors (``TenantUsage.floor_blocks``), not what they hold. The difference is reclaimable
    on demand: an ``on_demand`` engine keeps tokens above a request's budget while memory
    is free, and the plan's pressure takes them back as soon as the tenant's active KV
    passes its budget, so charging them at admission would refuse requests that fit.
    Tenants at 0 are omitted."""
    committed: dict[str, int] = {}
    for report in reports.values():
        for tenant_id, tenant in report.tenants.items():
            if tenant.floor_blocks:
                committed[tenant_id] = committed.get(tenant_id, 0) + tenant.floor_blocks
    return committed


def _initial_loads(live: Mapping[str, ReplicaReport], routes: dict[str, list[str]]) -> _Loads:
    capacity = {r: rep.total_blocks for r, rep in live.items()}
    load: dict[str, float] = {}
    for replica_id, report in live.items():
        leaving = sum(
            usage.blocks
            for tenant_id, usage in report.tenants.items()
            if replica_id not in routes.get(tenant_id, ())
        )
        load[replica_id] = float(max(0, report.total_blocks - report.available_blocks - leaving))
    return _Loads(capacity, load)


def _relieve(
    live: Mapping[str, ReplicaReport],
    routes: dict[str, list[str]],
    loads: _Loads,
    config: PlannerConfig,
) -> None:
    overloaded = [r for r in live if loads.utilisation(r) > config.high_watermark]
    overloaded.sort(key=lambda r: (-loads.utilisation(r), r))
    for replica_id in overloaded:
        held = live[replica_id].tenants
        here = [t for t, u in held.items() if u.blocks and replica_id in routes.get(t, ())]
        here.sort(key=lambda t: (-held[t].blocks, t))
        for tenant_id in here:
            if loads.utilisation(replica_id) <= config.low_watermark:
                break
            blocks = held[tenant_id].blocks
            route = routes[tenant_id]
            if len(route) > 1:
                route.remove(replica_id)
                loads.add(replica_id, -blocks)
                continue
            target = loads.least_utilised(exclude=[replica_id])
            if target is None or (
                (loads.load[target] + blocks) / loads.capacity[target] > config.low_watermark
            ):
                break  # nowhere to put it without overloading another replica
            routes[tenant_id] = [target]
            loads.add(replica_id, -blocks)
            loads.add(target, blocks)


def _size_warm_sets(
    quotas: Mapping[str, TenantQuota],
    usage: Mapping[str, int],
    routes: dict[str, list[str]],
    loads: _Loads,
    config: PlannerConfig,
) -> None:
    mean_capacity = sum(loads.capacity.values()) / len(loads.capacity)
    per_replica = config.hot_tenant_fraction * mean_capacity
    limit = min(config.max_replicas_per_tenant, len(loads.capacity))
    # Most tenants have one replica and fit on it: nothing to do (keeps 10000 tenants
    # cheap). The rest are placed heaviest-weight, then largest, first.
    pending = [t for t in quotas if len(routes.get(t, ())) != 1 or usage.get(t, 0) > per_replica]
    pending.sort(key=lambda t: (-quotas[t].weight, -usage.get(t, 0), t))
    for tenant_id in pending:
        demand = max(usage.get(tenant_id, 0), config.min_demand_blocks)
        route = routes.setdefault(tenant_id, [])
        grow_to = min(limit, max(1, math.ceil(demand / per_replica)))
        keep_at_most = min(limit, max(1, math.ceil(2 * demand / per_replica)))
        while len(route) > keep_at_most:
            dropped = max(route, key=lambda r: (loads.utilisation(r), r))
            route.remove(dropped)
        while len(route) < grow_to or not route:
            target = loads.least_utilised(exclude=route)
            if target is None:
                break
            route.append(target)
            loads.add(target, demand / grow_to)


def _tenant_routes(
    quotas: Mapping[str, TenantQuota],
    usage: Mapping[str, int],
    routes: dict[str, list[str]],
    loads: _Loads,
    config: PlannerConfig,
) -> dict[str, dict[str, object]]:
    """Plain data for `TenantRoute`s (validated with the whole plan)."""
    headroom = {
        r: max(config.min_weight_headroom, 1.0 - loads.utilisation(r)) for r in loads.capacity
    }
    tenants: dict[str, dict[str, object]] = {}
    for tenant_id, quota in quotas.items():
        route = routes.get(tenant_id)
        if not route:
            continue
        total = sum(headroom[r] for r in route)
        used = usage.get(tenant_id, 0)
        tenants[tenant_id] = {
            "replicas": [{"replica_id": r, "weight": headroom[r] / total} for r in route],
            "usage_blocks": used,
            "over_budget": used > quota.kv_budget_blocks,
        }
    return tenants
