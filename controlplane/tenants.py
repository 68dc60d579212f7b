"""Removing a tenant: its keys, its reservations and its quota, in one atomic script.

Keys go first inside the script, and the script is atomic, so no moment exists where the
quota is gone but a key still maps to the tenant id: re-creating the id later never revives
an old key. Reservations (and their start times, deadlines and the prompt-token bucket)
would otherwise stay in Redis without a TTL. The per-tenant ``usage`` entry belongs to the
controller's plan and is rewritten by it.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from pydantic import BaseModel

from controlplane.keys import KeySpace

# KEYS: quotas, quotas version, api keys, the tenant's key ids, reservations, reservation
# starts, reservation deadlines, rate bucket, reservation total. ARGV: tenant id.
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
redis.call('DEL', KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9])
local existed = redis.call('HDEL', KEYS[1], tenant)
redis.call('INCR', KEYS[2])
return {existed, revoked, reservations}
"""


class TenantRemoval(BaseModel):
    """What :func:`remove_tenant` did (the body of ``DELETE /admin/tenants/{id}``)."""

    deleted: str
    existed: bool
    revoked_keys: int
    removed_reservations: int


async def remove_tenant(redis: aioredis.Redis, keys: KeySpace, tenant_id: str) -> TenantRemoval:
    """Revoke every key of ``tenant_id``, drop its reservations and rate bucket, then its
    quota, atomically. Leftovers are cleaned even when the quota is already gone
    (``existed`` is then ``False``); running requests' later releases find nothing to free."""
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
    ]
    existed, revoked, reservations = await script(keys=names, args=[tenant_id])
    return TenantRemoval(
        deleted=tenant_id,
        existed=bool(existed),
        revoked_keys=int(revoked),
        removed_reservations=int(reservations),
    )
