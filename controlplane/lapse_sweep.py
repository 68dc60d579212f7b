"""Lapsed reservations of tenants that send nothing more, purged in the background.

A reservation lapses ``reservation_ttl_s`` after its last renewal (its ingress died).
Admission purges a tenant's lapsed reservations when the tenant next asks for admission;
until then they count in its total and in the cluster's (``cluster_kv_blocks``). A tenant
that never asks again would hold that share of the cluster for good: :func:`sweep_lapsed`
runs admission's own purge (``admission_scripts.SWEEP_LAPSED``, atomic per tenant) for
each tenant whose earliest reservation deadline has passed. The controller calls it every
``ControllerConfig.lapse_sweep_cycles`` leader cycles.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from controlplane.admission_scripts import SWEEP_LAPSED
from controlplane.keys import KeySpace, reservation_keys


async def sweep_lapsed(
    redis: aioredis.Redis, keys: KeySpace, tenant_ids: Iterable[str], reservation_ttl_s: float
) -> int:
    """Purge the lapsed reservations of ``tenant_ids``; how many lapsed. One pipelined
    read for all tenants, then one script call per tenant with a lapsed reservation.
    ``reservation_ttl_s`` must be the ingresses' (how long a lapsed one may be renewed)."""
    tenants = list(tenant_ids)
    if not tenants:
        return 0
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
