"""The controller lease (SET NX PX + a fencing token) and the fenced plan write.

At most one controller holds the lease; each new grant takes the next fencing token from
a Redis counter. A plan write (the plan, the replicas' slices of it, the per-tenant usage
and the heartbeat) is one Lua script that checks, atomically with the write,
that the writer still holds the lease with its fence, that no higher fence has written,
and that the version grows. So two controllers never interleave plans, and a paused
controller whose lease lapsed cannot overwrite its successor's plan.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.models import RoutingPlan
from controlplane.plan_slices import SliceUpdate, slice_update

# KEYS: lease, fence counter, plan fence. ARGV: owner, ttl_ms.
# Returns {1, fence} when held (renewed or newly granted), {0, holder} otherwise.
# A new grant's fence is above both the counter and the fence of the last plan written:
# a lost counter (a Redis restart without persistence, an eviction) once restarted at 1,
# under the stored plan's fence, and every plan write was refused as stale while the
# leader kept renewing its lease, so no standby could take over either.
_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current then
  local owner, fence = string.match(current, '^(.*)|(%d+)$')
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, tonumber(fence)}
  end
  return {0, owner or current}
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
local fence = math.max(counter, tonumber(redis.call('GET', KEYS[3]) or '0')) + 1
redis.call('SET', KEYS[2], fence)
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. fence, 'NX', 'PX', ARGV[2])
return {1, fence}
"""

# KEYS: lease. ARGV: owner, fence.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] .. '|' .. ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: lease, plan, plan version, plan fence, usage, plan heartbeat, plan slices.
# ARGV: owner, fence, version, plan JSON ('' when the plan's content did not change: only
# the heartbeat and the usage are written), usage JSON (tenant -> blocks), usage ttl_ms,
# heartbeat (s), the slice count the stored slices hash must have ('' to replace it
# whole), the number n of slices to remove, n replica ids, then (replica id, slice JSON)
# pairs to write.
_WRITE_PLAN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] .. '|' .. ARGV[2] then
  return 'lease_lost'
end
local fence = tonumber(ARGV[2])
if fence < tonumber(redis.call('GET', KEYS[4]) or '0') then
  return 'stale_fence'
end
if ARGV[4] == '' and (redis.call('GET', KEYS[3]) ~= ARGV[3]
    or redis.call('EXISTS', KEYS[2]) == 0) then
  return 'plan_missing'
end
if ARGV[8] ~= '' then
  -- Slices are written as a difference: the stored hash must be the one it applies to.
  local kind = redis.call('TYPE', KEYS[7])['ok']
  local count = 0
  if kind == 'hash' then
    count = redis.call('HLEN', KEYS[7])
  elseif kind ~= 'none' then
    count = -1
  end
  if count ~= tonumber(ARGV[8]) then
    return 'plan_missing'
  end
end
if ARGV[4] ~= '' then
  -- A stored version that is not a number (a foreign write) is replaced, not compared.
  if tonumber(ARGV[3]) <= (tonumber(redis.call('GET', KEYS[3]) or '-1') or -1) then
    return 'stale_version'
  end
  redis.call('SET', KEYS[2], ARGV[4])
  redis.call('SET', KEYS[3], ARGV[3])
end
redis.call('SET', KEYS[4], ARGV[2])
redis.call('SET', KEYS[6], ARGV[7])
redis.call('DEL', KEYS[5])
for tenant, blocks in pairs(cjson.decode(ARGV[5])) do
  redis.call('HSET', KEYS[5], tenant, blocks)
end
redis.call('PEXPIRE', KEYS[5], ARGV[6])
if ARGV[8] == '' then
  redis.call('DEL', KEYS[7])
end
local removed = tonumber(ARGV[9])
for i = 10, 9 + removed do
  redis.call('HDEL', KEYS[7], ARGV[i])
end
for i = 10 + removed, #ARGV, 2 do
  redis.call('HSET', KEYS[7], ARGV[i], ARGV[i + 1])
end
return 'written'
"""


@dataclass(frozen=True, slots=True)
class LeaseHeld:
    fence: int


@dataclass(frozen=True, slots=True)
class LeaseNotHeld:
    holder: str


LeaseState = LeaseHeld | LeaseNotHeld


class PlanWrite(enum.Enum):
    """Outcome of a fenced plan write."""

    WRITTEN = "written"
    LEASE_LOST = "lease_lost"
    STALE_FENCE = "stale_fence"
    STALE_VERSION = "stale_version"
    PLAN_MISSING = "plan_missing"  # an unchanged plan whose stored copy is gone: rewrite it


class ControllerLease:
    """One controller's handle on the lease. `owner` must be unique per controller."""

    def __init__(
        self, redis: aioredis.Redis, owner: str, ttl_s: float, keys: KeySpace | None = None
    ) -> None:
        if not owner or "|" in owner:
            raise ValueError(f"lease owner must be non-empty and contain no '|': {owner!r}")
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be positive, got {ttl_s}")
        self.owner = owner
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.keys = keys if keys is not None else KeySpace()
        self._redis = redis
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)
        self._write_plan = redis.register_script(_WRITE_PLAN)

    async def acquire_or_renew(self) -> LeaseState:
        """Take the lease if free, extend it if ours; report the holder otherwise."""
        held, value = await self._acquire(
            keys=[self.keys.lease, self.keys.lease_fence, self.keys.plan_fence],
            args=[self.owner, self.ttl_ms],
        )
        return LeaseHeld(int(value)) if int(held) == 1 else LeaseNotHeld(str(value))

    async def release(self, fence: int) -> bool:
        """Give the lease up (on clean shutdown) so a standby takes over at once."""
        return bool(await self._release(keys=[self.keys.lease], args=[self.owner, fence]))

    async def write_plan(
        self,
        plan: RoutingPlan,
        usage_blocks: Mapping[str, int],
        usage_ttl_s: float,
        changed: bool = True,
        slices: SliceUpdate | None = None,
    ) -> PlanWrite:
        """Write `plan` and the per-tenant usage admission reads, iff still entitled to,
        and the plan heartbeat (`plan.created_s`). With ``changed=False`` (the plan's
        content equals the stored plan's) the stored plan and its version stay: readers
        that follow the version parse nothing, and the heartbeat tells them it is current.

        The replicas' slices (`controlplane/plan_slices.py`) are written in the same
        script: `slices` (computed off the event loop by the controller), or by default
        every slice of `plan`, replacing the stored ones. A difference whose base is not
        what is stored is refused as `PLAN_MISSING` (the caller rewrites whole).

        The usage expires `usage_ttl_s` after the write: when no controller measures any
        more, admission counts the reservations alone instead of frozen numbers."""
        if usage_ttl_s <= 0:
            raise ValueError(f"usage_ttl_s must be positive, got {usage_ttl_s}")
        if slices is None:
            slices = slice_update(plan, None)
        slice_args: list[str | int] = [
            "" if slices.replace else slices.expected_count,
            len(slices.removed),
            *slices.removed,
        ]
        for replica_id, value in slices.upserts.items():
            slice_args += [replica_id, value]
        outcome = await self._write_plan(
            keys=[
                self.keys.lease,
                self.keys.plan,
                self.keys.plan_version,
                self.keys.plan_fence,
                self.keys.usage,
                self.keys.plan_heartbeat,
                self.keys.plan_slices,
            ],
            args=[
                self.owner,
                plan.fence,
                plan.version,
                plan.model_dump_json() if changed else "",
                json.dumps(dict(usage_blocks), separators=(",", ":")),
                max(1, int(usage_ttl_s * 1000)),
                repr(plan.created_s),
                *slice_args,
            ],
        )
        return PlanWrite(outcome)
