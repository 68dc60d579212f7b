"""The read-only check before tokenizing, against a real redis-server: it refuses exactly
what admission would refuse whatever the prompt (concurrency at its limit, a bucket in
debt), by Redis's clock, and never counts a lapsed reservation."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from controlplane.admission import Admission, AdmissionConfig, AdmissionOutcome
from controlplane.keys import KeySpace
from controlplane.precheck import AdmissionPrecheck, Precheck
from controlplane.store import RedisStore
from tests.controlplane.builders import quota


async def test_a_tenant_at_its_concurrency_limit_is_refused(
    redis: aioredis.Redis, store: RedisStore, keys: KeySpace
) -> None:
    config = AdmissionConfig(block_size=16, throttle_retry_after_s=2.0)
    admission, precheck = Admission(redis, config, keys), AdmissionPrecheck(redis, config, keys)
    tenant = quota("acme", budget=100, max_concurrent_requests=2)
    await store.put_quota(tenant)
    assert await precheck.check(tenant) == Precheck(held=0)
    first = await admission.admit(tenant, "r1", prompt_tokens=16, max_tokens=16)
    assert await precheck.check(tenant) == Precheck(held=1)
    await admission.admit(tenant, "r2", prompt_tokens=16, max_tokens=16)
    assert await precheck.check(tenant) == Precheck(2, "max_concurrent_requests", 2.0)
    assert first.reservation is not None
    await admission.release(first.reservation)
    assert await precheck.check(tenant) == Precheck(held=1)
    unlimited = quota("acme", budget=100)  # the limit is the quota's, not the reservations'
    assert (await precheck.check(unlimited)).reason is None


async def test_lapsed_reservations_are_not_counted(
    redis: aioredis.Redis, store: RedisStore, keys: KeySpace
) -> None:
    """Only admission purges lapsed reservations: counting them would refuse the tenant
    forever once an ingress died holding its limit's worth."""
    config = AdmissionConfig(block_size=16, reservation_ttl_s=0.05)
    admission, precheck = Admission(redis, config, keys), AdmissionPrecheck(redis, config, keys)
    tenant = quota("acme", budget=100, max_concurrent_requests=1)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "r1", prompt_tokens=16, max_tokens=16)).admitted
    assert (await precheck.check(tenant)).reason == "max_concurrent_requests"
    await asyncio.sleep(0.1)  # Redis's clock passes the deadline
    assert await precheck.check(tenant) == Precheck(held=0)


async def test_a_bucket_in_debt_is_refused_until_it_has_refilled(
    redis: aioredis.Redis, store: RedisStore, keys: KeySpace
) -> None:
    config = AdmissionConfig(block_size=16, rate_burst_s=1.0)
    admission, precheck = Admission(redis, config, keys), AdmissionPrecheck(redis, config, keys)
    tenant = quota("acme", budget=1000, prompt_tokens_per_s=10)
    bulk = quota("bulk", budget=1000, prompt_tokens_per_s=10)
    for each in (tenant, bulk):
        await store.put_quota(each)
    assert (await precheck.check(tenant)).reason is None  # no bucket yet: a full one
    assert (await admission.admit(tenant, "small", prompt_tokens=4, max_tokens=1)).admitted
    assert (await precheck.check(tenant)).reason is None  # 6 tokens left: not in debt
    # A prompt over the bucket is taken from a full one and leaves it in debt (96 tokens).
    assert (await admission.admit(bulk, "large", prompt_tokens=106, max_tokens=1)).admitted
    checked = await precheck.check(bulk)
    assert checked.reason == "prompt_token_rate"
    assert 9.0 < checked.retry_after_s <= 9.6
    # Admission refuses any prompt meanwhile, the smallest too.
    refused = await admission.admit(bulk, "next", prompt_tokens=1, max_tokens=1)
    assert refused.outcome is AdmissionOutcome.THROTTLED
    assert refused.retry_after_s >= checked.retry_after_s
