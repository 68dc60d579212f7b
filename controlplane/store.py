"""The Redis store: tenant quotas, replica reports and the latest routing plan.

Quotas are a hash (tenant id -> JSON) plus a version counter bumped with every change.
Reports are one hash per replica (`report`: the report as JSON, `heartbeat_s`) with a
TTL, plus a sorted-set registry (replica id -> heartbeat), so the controller reads them
all in two round trips instead of a SCAN. Encoding and validating the JSON runs in
pydantic's Rust core (a hash field per counter cost a Python dict round trip per report,
~3x slower). Plans are written only through `ControllerLease.write_plan` (fenced); this
module reads them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.models import ReplicaReport, RoutingPlan, TenantQuota

logger = logging.getLogger(__name__)

# KEYS: report hashes. Returns each one's `report` field ('' where the hash expired, and
# `WRONG_TYPE` where the key holds something else: one foreign record must not fail the
# whole read with WRONGTYPE, which once stopped every plan until its registry entry aged out).
WRONG_TYPE = "!wrongtype"
_READ_REPORTS = f"""
local out = {{}}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'hash' then
    out[i] = redis.call('HGET', key, 'report') or ''
  elseif kind == 'none' then
    out[i] = ''
  else
    out[i] = '{WRONG_TYPE}'
  end
end
return out
"""


# KEYS: registry, then one report hash per report.
# ARGV: ttl_ms, then (replica id, heartbeat, report JSON) per report.
_PUBLISH_REPORTS = """
local ttl_ms = ARGV[1]
for i = 2, #KEYS do
  local at = 3 * (i - 2) + 2
  redis.call('HSET', KEYS[i], 'report', ARGV[at + 2], 'heartbeat_s', ARGV[at + 1])
  redis.call('PEXPIRE', KEYS[i], ttl_ms)
  redis.call('ZADD', KEYS[1], ARGV[at + 1], ARGV[at])
end
return #KEYS - 1
"""


@dataclass(frozen=True, slots=True)
class ReportSnapshot:
    """Reports read at `now_s`: `fresh` ones have a heartbeat within `max_age_s`;
    `stale_ids` are registered replicas whose report is older or already expired;
    `invalid_ids` had a hash that failed validation (treated as stale)."""

    now_s: float
    fresh: dict[str, ReplicaReport]
    stale_ids: frozenset[str]
    invalid_ids: frozenset[str]
    last_heartbeat_s: dict[str, float] = field(default_factory=dict)
    """Each registered replica's last heartbeat (its registry score), stale ones too."""


class InvalidQuotaError(ValueError):
    """A tenant's stored quota no longer validates (written by an incompatible version, or
    by hand): the tenant is known, but cannot be served until its quota is set again."""

    def __init__(self, tenant_id: str, problem: str) -> None:
        super().__init__(f"the stored quota of tenant {tenant_id!r} is invalid: {problem}")
        self.tenant_id = tenant_id


def _first_error(error: ValueError) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}"
    return str(error)


@dataclass(frozen=True, slots=True)
class PlanHead:
    """What followers poll: the plan's ``version`` (moves with its content) and the
    leader's ``heartbeat_s`` (moves every cycle); ``None`` before the first plan, or
    while the stored value does not parse."""

    version: int | None
    heartbeat_s: float | None


def _parse(kind: type[int] | type[float], raw: Any, what: str) -> Any:
    """``kind(raw)``; ``None`` when missing, and when malformed (logged: a follower falls
    back as it does without a plan instead of dying on a ``ValueError`` in its loop)."""
    if raw is None:
        return None
    try:
        return kind(raw)
    except ValueError:
        logger.error("store: %s %r does not parse, ignored", what, str(raw)[:64])
        return None


class RedisStore:
    """Typed access to the control plane's Redis keys.

    `redis` must be created with `decode_responses=True` (see `redis_conn.connect`).
    Every method may raise a Redis connection error; callers that loop back off and retry.
    """

    def __init__(self, redis: aioredis.Redis, keys: KeySpace | None = None) -> None:
        self.redis = redis
        self.keys = keys if keys is not None else KeySpace()
        self._read_reports_script = redis.register_script(_READ_REPORTS)
        self._publish_script = redis.register_script(_PUBLISH_REPORTS)

    # Quotas -----------------------------------------------------------------------------

    async def put_quota(self, quota: TenantQuota) -> None:
        """Create or replace a tenant's quota."""
        await self.put_quotas([quota])

    async def put_quotas(self, quotas: Iterable[TenantQuota]) -> int:
        """Create or replace many quotas atomically (one MULTI); returns the count."""
        mapping = {quota.tenant_id: quota.model_dump_json() for quota in quotas}
        if mapping:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self.keys.quotas, mapping=mapping)  # type: ignore[arg-type]
                pipe.incr(self.keys.quotas_version)
                await pipe.execute()
        return len(mapping)

    async def get_quota(self, tenant_id: str) -> TenantQuota | None:
        """The tenant's quota, or None when the tenant does not exist; raises
        :class:`InvalidQuotaError` when its stored record no longer validates."""
        raw = await self.redis.hget(self.keys.quotas, tenant_id)
        if raw is None:
            return None
        try:
            return TenantQuota.model_validate_json(raw, extra="ignore")
        except ValueError as error:
            raise InvalidQuotaError(tenant_id, _first_error(error)) from None

    async def invalid_quotas(self) -> dict[str, str]:
        """Tenant id -> why its stored quota does not validate (an operator re-sets it with
        a PUT); the tenants :meth:`list_quotas` leaves out."""
        raw: dict[str, str] = await self.redis.hgetall(self.keys.quotas)  # type: ignore[assignment]
        invalid = {}
        for tenant_id, value in raw.items():
            try:
                TenantQuota.model_validate_json(value, extra="ignore")
            except ValueError as error:
                invalid[tenant_id] = _first_error(error)
        return invalid

    async def delete_quota(self, tenant_id: str) -> bool:
        """Delete a tenant's quota only; True when it existed. Deleting a tenant for good
        (keys and reservations too, atomically) is :func:`controlplane.tenants.remove_tenant`."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys.quotas, tenant_id)
            pipe.incr(self.keys.quotas_version)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def read_quotas_version(self) -> int:
        """Grows with every quota change (0 before the first)."""
        raw = await self.redis.get(self.keys.quotas_version)
        return 0 if raw is None else int(raw)

    async def list_quotas(self) -> dict[str, TenantQuota]:
        """Every tenant's quota. A stored quota that no longer validates (written by an
        incompatible version) is left out and logged, so one bad record cannot stop
        the controller; admission still reads it."""
        raw: dict[str, str] = await self.redis.hgetall(self.keys.quotas)  # type: ignore[assignment]
        quotas: dict[str, TenantQuota] = {}
        for tenant_id, value in raw.items():
            try:
                quotas[tenant_id] = TenantQuota.model_validate_json(value, extra="ignore")
            except ValueError as error:
                logger.error("store: quota of tenant %r is invalid, skipped: %s", tenant_id, error)
        return quotas

    # Reports ----------------------------------------------------------------------------

    async def publish_report(self, report: ReplicaReport, ttl_s: float) -> None:
        """Write one report (hash + TTL + registry) in one round trip."""
        await self.publish_reports([report], ttl_s)

    async def publish_reports(self, reports: Iterable[ReplicaReport], ttl_s: float) -> int:
        """Write many reports in one script call (HSET, PEXPIRE, ZADD each); returns the count.

        One command per batch, not three per report: redis-py's per-command Python cost
        held a pipeline of HSET/PEXPIRE/ZADD to ~11,000 reports/s on 2 cores; this script
        wrote ~50,000/s (bench/RESULTS.md)."""
        if ttl_s <= 0:
            raise ValueError(f"report ttl_s must be positive, got {ttl_s}")
        keys = [self.keys.replicas]
        args: list[str | int] = [max(1, int(ttl_s * 1000))]
        for report in reports:
            keys.append(self.keys.replica(report.replica_id))
            args += [report.replica_id, repr(report.heartbeat_s), report.model_dump_json()]
        if len(keys) > 1:
            await self._publish_script(keys=keys, args=args)
        return len(keys) - 1

    async def read_reports(
        self, now_s: float, max_age_s: float, forget_after_s: float
    ) -> ReportSnapshot:
        """All registered replicas' reports, split into fresh and stale at `now_s`.

        Registry entries silent for more than `forget_after_s` are removed, so a replica
        that is gone for good stops being listed as drained. Heartbeats are the replicas'
        wall clocks compared with `now_s`: hosts must be NTP-synced well below `max_age_s`.
        """
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self.keys.replicas, "-inf", now_s - forget_after_s)
            pipe.zrange(self.keys.replicas, 0, -1, withscores=True)
            _, registered = await pipe.execute()
        replica_ids = [replica_id for replica_id, _ in registered]
        last_heartbeat_s = {replica_id: float(score) for replica_id, score in registered}
        raw_reports = await self._read_report_fields(replica_ids) if replica_ids else []
        fresh: dict[str, ReplicaReport] = {}
        stale: set[str] = set()
        invalid: set[str] = set()
        for replica_id, raw in zip(replica_ids, raw_reports, strict=True):
            if raw is None:
                stale.add(replica_id)
                continue
            if raw == WRONG_TYPE:
                logger.error("store: replica %r's report key holds another type", replica_id)
                invalid.add(replica_id)
                continue
            try:
                report = ReplicaReport.model_validate_json(raw, extra="ignore")
            except ValueError:
                invalid.add(replica_id)
                continue
            if now_s - report.heartbeat_s > max_age_s:
                stale.add(replica_id)
            else:
                fresh[replica_id] = report
        return ReportSnapshot(
            now_s, fresh, frozenset(stale | invalid), frozenset(invalid), last_heartbeat_s
        )

    async def _read_report_fields(self, replica_ids: list[str]) -> list[str | None]:
        """The `report` field of each replica's hash (None where expired), in one script
        call: one reply to parse instead of one per replica."""
        keys = [self.keys.replica(replica_id) for replica_id in replica_ids]
        values = await self._read_reports_script(keys=keys)
        return [value if value else None for value in values]

    # Prometheus targets -----------------------------------------------------------------

    async def advertise_metrics(self, replica_id: str, address: str, model_id: str) -> None:
        """Record where replica ``replica_id`` serves its Prometheus metrics."""
        value = json.dumps({"address": address, "model_id": model_id})
        await self.redis.hset(self.keys.metrics_targets, replica_id, value)

    async def read_metrics_targets(self, now_s: float, keep_s: float) -> dict[str, tuple[str, str]]:
        """Replica id -> (address, model id) of the endpoints of replicas registered with a
        report within ``keep_s`` of ``now_s``; the others' entries are deleted."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.metrics_targets)
            pipe.zrangebyscore(self.keys.replicas, now_s - keep_s, "+inf")
            advertised, recent = await pipe.execute()
        keep = set(recent)
        gone = [replica_id for replica_id in advertised if replica_id not in keep]
        if gone:
            await self.redis.hdel(self.keys.metrics_targets, *gone)
        targets = {}
        for replica_id, raw in advertised.items():
            if replica_id in keep:
                value = json.loads(raw)
                targets[replica_id] = (str(value["address"]), str(value.get("model_id", "")))
        return targets

    # Plans and usage --------------------------------------------------------------------

    async def read_plan_head(self) -> PlanHead:
        """The plan's version and heartbeat in one round trip (what followers poll)."""
        version, heartbeat = await self.redis.mget(self.keys.plan_version, self.keys.plan_heartbeat)
        return PlanHead(_parse(int, version, "plan version"), _parse(float, heartbeat, "heartbeat"))

    async def read_plan_version(self) -> int | None:
        """The latest plan's version (cheap to poll), or None before the first plan and
        while the stored version is not an integer (logged: readers fall back as they do
        without a plan instead of dying on a ``ValueError`` in their polling loops)."""
        return _parse(int, await self.redis.get(self.keys.plan_version), "plan version")

    async def read_plan(self) -> RoutingPlan | None:
        """The latest plan, or None before the first plan."""
        raw = await self.redis.get(self.keys.plan)
        return None if raw is None else RoutingPlan.model_validate_json(raw, extra="ignore")

    async def read_usage(self) -> dict[str, int]:
        """Per-tenant live KV blocks across the cluster, as of the latest plan."""
        raw: dict[str, str] = await self.redis.hgetall(self.keys.usage)  # type: ignore[assignment]
        return {tid: int(blocks) for tid, blocks in raw.items()}
