"""Lapsed reservations of tenants that send nothing more, purged in the background; the
cluster's reservation total set again from the tenants' totals.

A reservation lapses ``reservation_ttl_s`` after its last renewal (its ingress died).
Admission purges a tenant's lapsed reservations when the tenant next asks for admission;
until then they count in its total and in the cluster's (``cluster_kv_blocks``). A tenant
that never asks again would hold that share of the cluster for good: :func:`sweep_lapsed`
runs admission's own purge (``admission_scripts.SWEEP_LAPSED``, atomic per tenant) for
each tenant whose earliest reservation deadline has passed, then
:func:`reconcile_cluster_total` sets the cluster's total (``KeySpace.
cluster_reservation_total``) to the sum of the tenants' totals: a cluster total that
started after reservations were taken (an upgrade) or was lost is right again within one
sweep. The controller calls it every ``ControllerConfig.lapse_sweep_cycles`` leader cycles.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from controlplane.admission_scripts import SWEEP_LAPSED
from controlplane.keys import KeySpace, reservation_keys

RECONCILE_TRIES = 3
"""Reads of the tenants before giving up a reconciliation (one per tenant created or
deleted between the read and the script)."""

# KEYS: quotas, the cluster's reservation total, then each tenant's reservation total in
# ARGV's order. ARGV: the tenants' ids, every tenant of `quotas` once. Sets the cluster's
# total to the sum of the tenants' totals, atomically with every script that moves them:
# {1, the total}; {0, 0} without writing when `quotas` holds other tenants (read again).
RECONCILE_CLUSTER_TOTAL = """
if redis.call('HLEN', KEYS[1]) ~= #ARGV then return {0, 0} end
local sum = 0
for i, tenant in ipairs(ARGV) do
  if redis.call('HEXISTS', KEYS[1], tenant) == 0 then return {0, 0} end
  sum = sum + math.max(0, tonumber(redis.call('GET', KEYS[i + 2]) or '0') or 0)
end
redis.call('SET', KEYS[2], sum)
return {1, sum}
"""


async def sweep_lapsed(
    redis: aioredis.Redis, keys: KeySpace, tenant_ids: Iterable[str], reservation_ttl_s: float
) -> int:
    """Purge the lapsed reservations of ``tenant_ids``, then reconcile the cluster's total
    (:func:`reconcile_cluster_total`); how many lapsed. One pipelined read for all tenants,
    then one script call per tenant with a lapsed reservation. ``reservation_ttl_s`` must
    be the ingresses' (how long a lapsed one may be renewed)."""
    tenants = list(tenant_ids)
    lapsed = 0
    if tenants:
        lapsed = await _purge(redis, keys, tenants, reservation_ttl_s)
    await reconcile_cluster_total(redis, keys)
    return lapsed


async def _purge(
    redis: aioredis.Redis, keys: KeySpace, tenants: list[str], reservation_ttl_s: float
) -> int:
    seconds, microseconds = await redis.time()
    now_ms = seconds * 1000 + microseconds // 1000
    async with redis.pipeline(transaction=False) as pipe:
        for tenant_id in tenants:
            pipe.zrange(keys.reservation_deadlines(tenant_id), 0, 0, withscores=True)
        earliest = await pipe.execute()
    script = redis.register_script(SWEEP_LAPSED)
    lapsed = 0
    for tenant_id, first in zip(tenants, earliest, strict=True):
        if first and first[0][1] <= now_ms:
            args: list[str | int] = ["", "", "", int(reservation_ttl_s * 1000)]
            lapsed += int(await script(keys=reservation_keys(keys, tenant_id), args=args))
    return lapsed


async def reconcile_cluster_total(redis: aioredis.Redis, keys: KeySpace) -> int | None:
    """Set the cluster's reservation total to the sum of every stored tenant's total, in
    one script that names each tenant's key; the total set, or ``None`` when the tenants
    changed under each of :data:`RECONCILE_TRIES` reads (the next sweep tries again)."""
    script = redis.register_script(RECONCILE_CLUSTER_TOTAL)
    for _ in range(RECONCILE_TRIES):
        tenants: list[str] = await redis.hkeys(keys.quotas)  # type: ignore[assignment]
        totals = [keys.reservation_total(tenant_id) for tenant_id in tenants]
        names = [keys.quotas, keys.cluster_reservation_total, *totals]
        written, total = await script(keys=names, args=tenants)
        if written:
            return int(total)
    return None
