"""A tenant's lifecycle in atomic scripts: writing its quota with a key, adding a key,
and removing it (its keys, its reservations and its quota).

Writes check the tenant's existence inside the same script: a key added while its tenant
is being deleted once survived the deletion and authenticated as a later tenant of the
same id, and a ``PUT`` that saw the tenant before a ``DELETE`` re-created it without a key.

Keys go first inside the script, and the script is atomic, so no moment exists where the
quota is gone but a key still maps to the tenant id: re-creating the id later never revives
an old key. Reservations (and their start times, deadlines and the prompt-token bucket)
would otherwise stay in Redis without a TTL; the tenant's fair-queue state goes too, so
its tickets stop contending for the cluster at once and a tenant later created under the
same id starts with no counter. The per-tenant ``usage`` entry belongs to the
controller's plan and is rewritten by it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import BaseModel

from controlplane.auth import digest, key_id
from controlplane.keys import KeySpace, queue_keys
from controlplane.models import TenantQuota

# KEYS: quotas, quotas version, api keys, the tenant's key ids.
# ARGV: tenant id, quota JSON ('' to add a key to an existing tenant), key digest ('' for
# none), key id, 'chosen' or 'generated' (a generated key is given to a new tenant only).
# Returns {outcome, existed}: outcome 'key', 'no_key', 'key_conflict' or 'no_tenant'.
_WRITE_TENANT = """
local existed = redis.call('HEXISTS', KEYS[1], ARGV[1])
if ARGV[2] == '' and existed == 0 then return {'no_tenant', 0} end
local give_key = ARGV[3] ~= '' and (ARGV[5] == 'chosen' or existed == 0)
if give_key then
  local owner = redis.call('HGET', KEYS[3], ARGV[3])
  if owner and owner ~= ARGV[1] then return {'key_conflict', existed} end
  redis.call('HSET', KEYS[3], ARGV[3], ARGV[1])
  redis.call('HSET', KEYS[4], ARGV[4], ARGV[3])
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('INCR', KEYS[2])
end
if give_key then return {'key', existed} end
return {'no_key', existed}
"""

# KEYS: quotas, quotas version, api keys, the tenant's key ids, reservations, reservation
# starts, reservation deadlines, rate bucket, reservation total, lapsed, lapsed-at, the
# cluster's reservation total (less the tenant's, never below 0), then the fair queue's:
# the tenant's tickets and their leases, the active, contending and tenant-lease sets and
# the counters (the tenant leaves each). ARGV: tenant id.
# Returns {quota existed (0/1), keys revoked, reservations removed}.
# The scan of every key digest also catches keys stored before key ids existed; it runs
# once per tenant deletion (an admin action), O(all keys).
_REMOVE_TENANT = """
local tenant = ARGV[1]
local revoked = 0
local indexed = redis.call('HVALS', KEYS[4])
for _, key_digest in ipairs(indexed) do
  if redis.call('HGET', KEYS[3], key_digest) == tenant then
    redis.call('HDEL', KEYS[3], key_digest)
    revoked = revoked + 1
  end
end
local all = redis.call('HGETALL', KEYS[3])
for i = 1, #all, 2 do
  if all[i + 1] == tenant then
    redis.call('HDEL', KEYS[3], all[i])
    revoked = revoked + 1
  end
end
local reservations = redis.call('HLEN', KEYS[5])
local held = tonumber(redis.call('GET', KEYS[9]) or '0')
if redis.call('DECRBY', KEYS[12], held) < 0 then redis.call('SET', KEYS[12], 0) end
redis.call('DEL', KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11])
redis.call('DEL', KEYS[13], KEYS[14])
for i = 15, 17 do redis.call('ZREM', KEYS[i], tenant) end
redis.call('HDEL', KEYS[18], tenant)
local existed = redis.call('HDEL', KEYS[1], tenant)
redis.call('INCR', KEYS[2])
return {existed, revoked, reservations}
"""


class TenantWriteOutcome(enum.Enum):
    KEY = "key"  # written, and the key given to the tenant
    NO_KEY = "no_key"  # written; no key given (none asked, or a generated one, not new)
    KEY_CONFLICT = "key_conflict"  # the key belongs to another tenant: nothing written
    NO_TENANT = "no_tenant"  # a key for a tenant that does not exist: nothing written


@dataclass(frozen=True, slots=True)
class TenantWrite:
    outcome: TenantWriteOutcome
    existed: bool
    key_id: str | None
    """The key's id when ``outcome`` is ``KEY``."""


async def write_tenant(
    redis: aioredis.Redis,
    keys: KeySpace,
    tenant_id: str,
    quota: TenantQuota | None,
    api_key: str | None,
    chosen: bool,
) -> TenantWrite:
    """In one script: create or replace ``quota`` (``None``: the tenant must exist, its
    quota stays) and give the tenant ``api_key``. A ``chosen`` key is always given; a
    generated one (``chosen=False``) only when the tenant is new, so a replaced tenant
    keeps its keys and a new one always gets one. Nothing is written on a conflict."""
    if quota is not None and quota.tenant_id != tenant_id:
        raise ValueError(f"quota of {quota.tenant_id!r} written as {tenant_id!r}")
    script = redis.register_script(_WRITE_TENANT)
    names = [keys.quotas, keys.quotas_version, keys.api_keys, keys.tenant_api_keys(tenant_id)]
    args = [
        tenant_id,
        "" if quota is None else quota.model_dump_json(),
        "" if api_key is None else digest(api_key),
        "" if api_key is None else key_id(api_key),
        "chosen" if chosen else "generated",
    ]
    raw_outcome, existed = await script(keys=names, args=args)
    outcome = TenantWriteOutcome(
        raw_outcome.decode() if isinstance(raw_outcome, bytes) else raw_outcome
    )
    given = key_id(api_key) if outcome is TenantWriteOutcome.KEY and api_key else None
    return TenantWrite(outcome, bool(existed), given)


class TenantRemoval(BaseModel):
    """What :func:`remove_tenant` did (the body of ``DELETE /admin/tenants/{id}``)."""

    deleted: str
    existed: bool
    revoked_keys: int
    removed_reservations: int


async def remove_tenant(redis: aioredis.Redis, keys: KeySpace, tenant_id: str) -> TenantRemoval:
    """Revoke every key of ``tenant_id``, drop its reservations, rate bucket and place in
    the fair queue (its tickets and counter), then its quota, atomically. Leftovers are
    cleaned even when the quota is already gone (``existed`` is then ``False``); running
    requests' later releases find nothing to free."""
    script = redis.register_script(_REMOVE_TENANT)
    names = [
        keys.quotas,
        keys.quotas_version,
        keys.api_keys,
        keys.tenant_api_keys(tenant_id),
        keys.reservations(tenant_id),
        keys.reservation_starts(tenant_id),
        keys.reservation_deadlines(tenant_id),
        keys.rate_bucket(tenant_id),
        keys.reservation_total(tenant_id),
        keys.reservation_lapsed(tenant_id),
        keys.reservation_lapsed_at(tenant_id),
        keys.cluster_reservation_total,
        *queue_keys(keys, tenant_id),
        keys.queue_counters,
    ]
    existed, revoked, reservations = await script(keys=names, args=[tenant_id])
    return TenantRemoval(
        deleted=tenant_id,
        existed=bool(existed),
        revoked_keys=int(revoked),
        removed_reservations=int(reservations),
    )
