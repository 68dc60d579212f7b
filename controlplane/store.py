"""The Redis store: tenant quotas, replica reports and the latest routing plan.

Quotas are a hash (tenant id -> JSON) plus a version counter bumped with every change.
Reports are one hash per replica (`report`: the report as JSON, `heartbeat_s`, and the
prefix keys in fields of their own: `controlplane/report_rows.py`) with a TTL, plus a
sorted-set registry (replica id -> heartbeat), so the controller reads them all in two
round trips instead of a SCAN. Encoding and validating the JSON runs in pydantic's Rust
core (a hash field per counter cost a Python dict round trip per report, ~3x slower).
Plans and their per-replica slices are written only through `ControllerLease.write_plan`
(fenced); this module reads them.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from controlplane import store_scripts as scripts
from controlplane.keys import KeySpace
from controlplane.models import ReplicaReport, RoutingPlan, TenantQuota
from controlplane.report_rows import (
    PrefixKeys,
    ReportRows,
    ReportSnapshot,
    parse_prefix_keys,
    parse_reports,
)

logger = logging.getLogger(__name__)

_NOT_IN_REPORT = {"prefix_keys"}  # stored in a key of their own


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


@dataclass(frozen=True, slots=True)
class SliceRead:
    """What a replica polls: its plan slice's JSON (None while no plan names it) and the
    leader's heartbeat (None before any, or while it does not parse)."""

    raw_slice: str | None
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


def parse_quotas(raw: Mapping[str, str]) -> dict[str, TenantQuota]:
    """The quotas of `raw` (tenant id -> JSON). A stored quota that no longer validates
    (written by an incompatible version) is left out and logged, so one bad record cannot
    stop the controller; admission still reads it. Pure: may run off the event loop."""
    quotas: dict[str, TenantQuota] = {}
    for tenant_id, value in raw.items():
        try:
            quotas[tenant_id] = TenantQuota.model_validate_json(value, extra="ignore")
        except ValueError as error:
            logger.error("store: quota of tenant %r is invalid, skipped: %s", tenant_id, error)
    return quotas


def parse_plan(raw: str | None) -> RoutingPlan | None:
    """The plan of `raw` (None for None); `ValueError` when it does not validate."""
    return None if raw is None else RoutingPlan.model_validate_json(raw, extra="ignore")


class RedisStore:
    """Typed access to the control plane's Redis keys.

    `redis` must be created with `decode_responses=True` (see `redis_conn.connect`).
    Every method may raise a Redis connection error; callers that loop back off and retry.
    """

    def __init__(self, redis: aioredis.Redis, keys: KeySpace | None = None) -> None:
        self.redis = redis
        self.keys = keys if keys is not None else KeySpace()
        self._read_reports_script = redis.register_script(scripts.READ_REPORTS)
        self._read_tags_script = redis.register_script(scripts.READ_PREFIX_TAGS)
        self._publish_script = redis.register_script(scripts.PUBLISH_REPORTS)
        self._read_slice_script = redis.register_script(scripts.READ_PLAN_SLICE)
        # Prefix keys last written per replica id: keys, tag (unique per store), when.
        self._prefix_sent: dict[str, tuple[tuple[str, ...], str, float]] = {}
        self._prefix_nonce = secrets.token_hex(4)
        self._prefix_tags = 0

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
        """Every tenant's quota (see :func:`parse_quotas`)."""
        return parse_quotas(await self.read_raw_quotas())

    async def read_raw_quotas(self) -> dict[str, str]:
        """Tenant id -> stored quota JSON, for :func:`parse_quotas`."""
        raw: dict[str, str] = await self.redis.hgetall(self.keys.quotas)  # type: ignore[assignment]
        return raw

    # Reports ----------------------------------------------------------------------------

    async def publish_report(
        self, report: ReplicaReport, ttl_s: float, prefix_keys_period_s: float = 0.0
    ) -> None:
        """Write one report (hash + TTL + registry) in one round trip."""
        await self.publish_reports([report], ttl_s, prefix_keys_period_s)

    async def publish_reports(
        self, reports: Iterable[ReplicaReport], ttl_s: float, prefix_keys_period_s: float = 0.0
    ) -> int:
        """Write many reports in one script call (HSET, PEXPIRE, ZADD each); returns the count.

        One command per batch, not three per report: redis-py's per-command Python cost
        held a pipeline of HSET/PEXPIRE/ZADD to ~11,000 reports/s on 2 cores; this script
        wrote ~50,000/s (bench/RESULTS.md).

        A report's prefix keys (1,024 are ~17 kB, ~8x the rest of a report) go to their own
        key with a plain SET before the script (through Lua, 1,000 of them took Redis
        ~100 ms), and only when they differ from the ones this store last wrote for the
        replica, at most once per `prefix_keys_period_s` of the report's clock (routers
        read them once a second). The script tags the report with the keys' tag and keeps
        their key alive; it names replicas whose keys key is gone (expired while the
        replica was away), which are written again next time."""
        if ttl_s <= 0:
            raise ValueError(f"report ttl_s must be positive, got {ttl_s}")
        ttl_ms = max(1, int(ttl_s * 1000))
        keys = [self.keys.replicas]
        args: list[str | int] = [ttl_ms]
        sending: dict[str, tuple[tuple[str, ...], str, float]] = {}
        for report in reports:
            replica_id = report.replica_id
            keys += [self.keys.replica(replica_id), self.keys.replica_prefix_keys(replica_id)]
            sent = self._prefix_sent.get(replica_id)
            if sent is None or (
                sent[0] != report.prefix_keys
                and report.heartbeat_s - sent[2] >= prefix_keys_period_s
            ):
                self._prefix_tags += 1
                tag = f"{self._prefix_nonce}.{self._prefix_tags}"
                sending[replica_id] = (report.prefix_keys, tag, report.heartbeat_s)
            else:
                tag = sent[1]
            report_json = report.model_dump_json(exclude=_NOT_IN_REPORT)
            args += [replica_id, repr(report.heartbeat_s), report_json, tag]
        if len(keys) == 1:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for replica_id, (prefix_keys, tag, _) in sending.items():
                value = " ".join((tag, *prefix_keys))
                pipe.set(self.keys.replica_prefix_keys(replica_id), value, px=ttl_ms)
            await self._publish_script(keys=keys, args=args, client=pipe)
            *_, resend = await pipe.execute()
        self._prefix_sent.update(sending)
        for replica_id in resend:
            self._prefix_sent.pop(replica_id, None)
        return (len(keys) - 1) // 2

    async def read_reports(
        self, now_s: float, max_age_s: float, forget_after_s: float
    ) -> ReportSnapshot:
        """All registered replicas' reports, split into fresh and stale at `now_s`,
        without their prefix keys (see :meth:`read_prefix_keys`)."""
        return parse_reports(await self.read_report_rows(now_s, forget_after_s), max_age_s)

    async def read_report_rows(self, now_s: float, forget_after_s: float) -> ReportRows:
        """The registered replicas and their raw reports, for :func:`parse_reports`.

        Registry entries silent for more than `forget_after_s` are removed, so a replica
        that is gone for good stops being listed as drained. Heartbeats are the replicas'
        wall clocks compared with `now_s`: hosts must be NTP-synced well below the age a
        report counts as fresh.
        """
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self.keys.replicas, "-inf", now_s - forget_after_s)
            pipe.zrange(self.keys.replicas, 0, -1, withscores=True)
            _, registered = await pipe.execute()
        replica_ids = [replica_id for replica_id, _ in registered]
        last_heartbeat_s = {replica_id: float(score) for replica_id, score in registered}
        raw_reports: list[str | None] = []
        if replica_ids:
            keys = [self.keys.replica(replica_id) for replica_id in replica_ids]
            values = await self._read_reports_script(keys=keys)
            raw_reports = [value if value else None for value in values]
        return ReportRows(now_s, replica_ids, last_heartbeat_s, raw_reports)

    async def read_prefix_keys(self, known_tags: Mapping[str, str]) -> dict[str, PrefixKeys]:
        """The prefix keys of the replicas in `known_tags` (replica id -> the tag the
        caller holds, '' for none) whose reports carry another tag: only what changed
        crosses the network and is parsed. Two round trips: the tags (one script call),
        then one MGET of the changed keys. A replica whose keys are missing, or another
        type, is left out (and asked again next time)."""
        replica_ids = list(known_tags)
        if not replica_ids:
            return {}
        tags = await self._read_tags_script(
            keys=[self.keys.replica(replica_id) for replica_id in replica_ids]
        )
        moved = [r for r, tag in zip(replica_ids, tags, strict=True) if tag != known_tags[r]]
        if not moved:
            return {}
        values: list[str | None] = await self.redis.mget(  # type: ignore[assignment]
            [self.keys.replica_prefix_keys(r) for r in moved]
        )
        return {
            replica_id: parse_prefix_keys(replica_id, value)
            for replica_id, value in zip(moved, values, strict=True)
            if value
        }

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

    async def read_plan_slice(self, replica_id: str) -> SliceRead:
        """`replica_id`'s plan slice and the leader's heartbeat, read atomically (one
        script call of a few hundred bytes: what engines poll instead of the plan)."""
        raw, heartbeat = await self._read_slice_script(
            keys=[self.keys.plan_slices, self.keys.plan_heartbeat], args=[replica_id]
        )
        return SliceRead(raw or None, _parse(float, heartbeat or None, "heartbeat"))

    async def read_plan_version(self) -> int | None:
        """The latest plan's version (cheap to poll), or None before the first plan and
        while the stored version is not an integer (logged: readers fall back as they do
        without a plan instead of dying on a ``ValueError`` in their polling loops)."""
        return _parse(int, await self.redis.get(self.keys.plan_version), "plan version")

    async def read_plan(self) -> RoutingPlan | None:
        """The latest plan, or None before the first plan."""
        return parse_plan(await self.read_raw_plan())

    async def read_raw_plan(self) -> str | None:
        """The latest plan's JSON, for :func:`parse_plan`."""
        raw: str | None = await self.redis.get(self.keys.plan)  # type: ignore[assignment]
        return raw

    async def read_usage(self) -> dict[str, int]:
        """Per-tenant live KV blocks across the cluster, as of the latest plan."""
        raw: dict[str, str] = await self.redis.hgetall(self.keys.usage)  # type: ignore[assignment]
        return {tid: int(blocks) for tid, blocks in raw.items()}
