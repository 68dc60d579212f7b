"""A tenant's concurrency and prompt-rate limits, read before its prompt is tokenized.

Tokenizing costs CPU (tens of ms for a long prompt); a tenant already at its
``max_concurrent_requests``, or whose prompt-token bucket is in debt, would be throttled by
admission whatever its prompt, so the ingress asks :meth:`AdmissionPrecheck.check` first
and answers 429 at once. It only reads: the admission script (:mod:`controlplane.admission`)
still decides after tokenizing, so a request this lets through may be throttled there.

It reads what admission reads, by Redis's clock: the tenant's held reservations are its
reservation deadlines still ahead (lapsed ones no longer count, as admission purges them
before it counts), and the bucket is refilled from its last state as admission refills it
(``admission_scripts.TAKE_PROMPT_TOKENS``: ``capacity = rate * rate_burst_s``; a
missing bucket is full).
A bucket below zero tokens refuses every prompt, of any size, until it refills to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from controlplane.admission import AdmissionConfig
from controlplane.admission_scripts import NOW_MS
from controlplane.keys import KeySpace
from controlplane.models import TenantQuota

# KEYS: reservation deadlines, rate bucket, sequences. ARGV: rate per s (0: none), burst
# seconds. Returns {held sequences, ms until the bucket is out of debt (0: not in debt)}.
# The sequences held are admission's count (`max_concurrent_requests` counts sequences),
# and none while no reservation is live (lapsed ones no longer count).
_PRECHECK = (
    NOW_MS
    + """
local now = now_ms()
local held = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
if held > 0 then held = math.max(held, tonumber(redis.call('GET', KEYS[3]) or '0') or 0) end
local rate = tonumber(ARGV[1])
if rate <= 0 then return {held, 0} end
local state = redis.call('HMGET', KEYS[2], 'tokens', 'at_ms')
if not (state[1] and state[2]) then return {held, 0} end
local capacity = rate * tonumber(ARGV[2])
local refilled = math.max(0, now - tonumber(state[2])) * rate / 1000
local tokens = math.min(capacity, tonumber(state[1]) + refilled)
if tokens >= 0 then return {held, 0} end
return {held, math.ceil(-tokens * 1000 / rate)}
"""
)


@dataclass(frozen=True, slots=True)
class Precheck:
    """``held``: the tenant's sequences held now. ``reason`` is ``None`` when admission
    may admit, else why it cannot (``max_concurrent_requests`` or ``prompt_token_rate``,
    admission's own reasons) and ``retry_after_s`` (> 0) says when to retry."""

    held: int
    reason: str | None = None
    retry_after_s: float = 0.0


class AdmissionPrecheck:
    """Reads a tenant's concurrency and prompt-token bucket (one read-only script)."""

    def __init__(self, redis: aioredis.Redis, config: AdmissionConfig, keys: KeySpace) -> None:
        self.config, self.keys = config, keys
        self._precheck = redis.register_script(_PRECHECK)

    async def check(self, quota: TenantQuota) -> Precheck:
        """Whether ``quota``'s tenant is at its concurrency limit or its bucket in debt."""
        tenant_id = quota.tenant_id
        held, wait_ms = await self._precheck(
            keys=[
                self.keys.reservation_deadlines(tenant_id),
                self.keys.rate_bucket(tenant_id),
                self.keys.reservation_sequences(tenant_id),
            ],
            args=[quota.prompt_tokens_per_s or 0, self.config.rate_burst_s],
        )
        limit = quota.max_concurrent_requests
        if limit is not None and int(held) >= limit:
            retry_after_s = self.config.throttle_retry_after_s
            return Precheck(int(held), "max_concurrent_requests", retry_after_s)
        if int(wait_ms) > 0:
            return Precheck(int(held), "prompt_token_rate", int(wait_ms) / 1000)
        return Precheck(int(held))
