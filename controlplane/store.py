"""The Redis store: tenant quotas, replica reports and the latest routing plan.

Quotas are a hash (tenant id -> JSON), persisted by Redis like any key. Reports are one
hash per replica with a TTL plus a sorted-set registry (replica id -> heartbeat) so the
controller reads them all with two pipelined round trips instead of a SCAN. Plans are
written only through `ControllerLease.write_plan` (fenced); this module reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.models import ReplicaReport, RoutingPlan, TenantQuota

_SCALAR_FIELDS = tuple(name for name in ReplicaReport.model_fields if name != "tenants")


def encode_report(report: ReplicaReport) -> dict[str, str]:
    """Report -> flat hash fields (scalars as text, `tenants` as JSON)."""
    fields = {name: str(getattr(report, name)) for name in _SCALAR_FIELDS}
    fields["draining"] = "1" if report.draining else "0"
    fields["heartbeat_s"] = repr(report.heartbeat_s)
    fields["tenants"] = json.dumps(
        {tid: usage.model_dump() for tid, usage in report.tenants.items()},
        separators=(",", ":"),
    )
    return fields


def decode_report(fields: Mapping[str, str]) -> ReplicaReport:
    """Hash fields -> report; raises `pydantic.ValidationError` on corrupt data."""
    data: dict[str, object] = dict(fields)
    data["tenants"] = json.loads(fields.get("tenants", "{}"))
    return ReplicaReport.model_validate(data)


@dataclass(frozen=True, slots=True)
class ReportSnapshot:
    """Reports read at `now_s`: `fresh` ones have a heartbeat within `max_age_s`;
    `stale_ids` are registered replicas whose report is older or already expired;
    `invalid_ids` had a hash that failed validation (treated as stale)."""

    now_s: float
    fresh: dict[str, ReplicaReport]
    stale_ids: frozenset[str]
    invalid_ids: frozenset[str]


class RedisStore:
    """Typed access to the control plane's Redis keys.

    `redis` must be created with `decode_responses=True` (see `redis_conn.connect`).
    Every method may raise a Redis connection error; callers that loop back off and retry.
    """

    def __init__(self, redis: aioredis.Redis, keys: KeySpace | None = None) -> None:
        self.redis = redis
        self.keys = keys if keys is not None else KeySpace()

    # Quotas -----------------------------------------------------------------------------

    async def put_quota(self, quota: TenantQuota) -> None:
        """Create or replace a tenant's quota."""
        await self.redis.hset(self.keys.quotas, quota.tenant_id, quota.model_dump_json())

    async def get_quota(self, tenant_id: str) -> TenantQuota | None:
        """The tenant's quota, or None when the tenant does not exist."""
        raw = await self.redis.hget(self.keys.quotas, tenant_id)
        return None if raw is None else TenantQuota.model_validate_json(raw)

    async def delete_quota(self, tenant_id: str) -> bool:
        """Delete a tenant; True when it existed. Its reservations lapse on their own."""
        return bool(await self.redis.hdel(self.keys.quotas, tenant_id))

    async def list_quotas(self) -> dict[str, TenantQuota]:
        raw: dict[str, str] = await self.redis.hgetall(self.keys.quotas)  # type: ignore[assignment]
        return {tid: TenantQuota.model_validate_json(value) for tid, value in raw.items()}

    # Reports ----------------------------------------------------------------------------

    async def publish_report(self, report: ReplicaReport, ttl_s: float) -> None:
        """Write one report (hash + TTL + registry) in one pipelined round trip."""
        await self.publish_reports([report], ttl_s)

    async def publish_reports(self, reports: Iterable[ReplicaReport], ttl_s: float) -> int:
        """Write many reports in one pipeline (HSET, PEXPIRE, ZADD each); returns the count."""
        if ttl_s <= 0:
            raise ValueError(f"report ttl_s must be positive, got {ttl_s}")
        ttl_ms = max(1, int(ttl_s * 1000))
        count = 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for report in reports:
                key = self.keys.replica(report.replica_id)
                pipe.hset(key, mapping=encode_report(report))  # type: ignore[arg-type]
                pipe.pexpire(key, ttl_ms)
                pipe.zadd(self.keys.replicas, {report.replica_id: report.heartbeat_s})
                count += 1
            await pipe.execute()
        return count

    async def read_reports(
        self, now_s: float, max_age_s: float, forget_after_s: float
    ) -> ReportSnapshot:
        """All registered replicas' reports, split into fresh and stale at `now_s`.

        Registry entries silent for more than `forget_after_s` are removed, so a replica
        that is gone for good stops being listed as drained.
        """
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self.keys.replicas, "-inf", now_s - forget_after_s)
            pipe.zrange(self.keys.replicas, 0, -1)
            _, replica_ids = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for replica_id in replica_ids:
                pipe.hgetall(self.keys.replica(replica_id))
            hashes = await pipe.execute()
        fresh: dict[str, ReplicaReport] = {}
        stale: set[str] = set()
        invalid: set[str] = set()
        for replica_id, fields in zip(replica_ids, hashes, strict=True):
            if not fields:
                stale.add(replica_id)
                continue
            try:
                report = decode_report(fields)
            except ValueError:
                invalid.add(replica_id)
                continue
            if now_s - report.heartbeat_s > max_age_s:
                stale.add(replica_id)
            else:
                fresh[replica_id] = report
        return ReportSnapshot(now_s, fresh, frozenset(stale | invalid), frozenset(invalid))

    # Plans and usage --------------------------------------------------------------------

    async def read_plan_version(self) -> int | None:
        """The latest plan's version (cheap to poll), or None before the first plan."""
        raw = await self.redis.get(self.keys.plan_version)
        return None if raw is None else int(raw)

    async def read_plan(self) -> RoutingPlan | None:
        """The latest plan, or None before the first plan."""
        raw = await self.redis.get(self.keys.plan)
        return None if raw is None else RoutingPlan.model_validate_json(raw)

    async def read_usage(self) -> dict[str, int]:
        """Per-tenant live KV blocks across the cluster, as of the latest plan."""
        raw: dict[str, str] = await self.redis.hgetall(self.keys.usage)  # type: ignore[assignment]
        return {tid: int(blocks) for tid, blocks in raw.items()}
