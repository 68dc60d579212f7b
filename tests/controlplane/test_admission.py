from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from controlplane import telemetry
from controlplane.admission import (
    Admission,
    AdmissionConfig,
    AdmissionOutcome,
    KVBounds,
    Reservation,
    kv_bounds,
)
from controlplane.keys import KeySpace
from controlplane.store import RedisStore
from tests.controlplane.builders import quota
from tests.controlplane.fakes import FakeClock


@pytest.fixture
def admission(redis: aioredis.Redis, keys: KeySpace, clock: FakeClock) -> Admission:
    return Admission(redis, clock, AdmissionConfig(block_size=16, reservation_ttl_s=60), keys)


def test_kv_bounds() -> None:
    assert kv_bounds(10, 6, 16, None) == KVBounds(prefill_peak=1, steady=1)
    assert kv_bounds(10, 7, 16, None) == KVBounds(prefill_peak=1, steady=2)
    # An eviction budget bounds the steady state (plus the step's block), not the prompt.
    assert kv_bounds(1000, 1000, 16, 64) == KVBounds(prefill_peak=63, steady=5)
    assert kv_bounds(1000, 1000, 16, 64).peak == 63
    assert kv_bounds(10, 6, 16, 64).steady == 1  # never above prompt + max_tokens
    # Without a tenant cap the engines' keep ratio bounds it: 0.5 x 2000 tokens + a block.
    assert kv_bounds(1000, 1000, 16, None, keep_ratio=0.5) == KVBounds(63, 64)
    assert kv_bounds(1000, 1000, 16, 64, keep_ratio=0.5).steady == 5  # the cap wins
    with pytest.raises(ValueError, match="prompt_tokens"):
        kv_bounds(-1, 5, 16, None)
    with pytest.raises(ValueError, match="not both 0"):
        kv_bounds(0, 0, 16, None)


async def test_a_prompt_larger_than_the_budget_is_never_held(
    redis: aioredis.Redis, keys: KeySpace, clock: FakeClock, store: RedisStore
) -> None:
    """Budget 10 blocks, eviction budget 48 tokens, 2,000-token prompts, block size 32: each
    prompt holds 63 blocks until its prefill ends, so none may be admitted (a reservation of
    the steady bound alone would admit five, 315 blocks against a budget of 10)."""
    admission = Admission(redis, clock, AdmissionConfig(block_size=32), keys)
    tenant = quota("acme", budget=10).model_copy(update={"eviction_budget_tokens": 48})
    await store.put_quota(tenant)
    for index in range(5):
        decision = await admission.admit(tenant, f"r{index}", 2000, 64)
        assert (decision.outcome, decision.reason) == (AdmissionOutcome.REJECTED, "exceeds_budget")
    assert await admission.reserved_blocks("acme") == 0


async def test_reservation_shrinks_to_its_steady_bound_after_prefill(
    redis: aioredis.Redis, keys: KeySpace, clock: FakeClock, store: RedisStore
) -> None:
    admission = Admission(redis, clock, AdmissionConfig(block_size=32), keys)
    tenant = quota("acme", budget=10).model_copy(update={"eviction_budget_tokens": 48})
    await store.put_quota(tenant)
    first = await admission.admit(tenant, "r1", 200, 64)  # peak 7 (prompt), steady 3
    assert first.reservation is not None and first.reservation.blocks == 7
    assert (await admission.admit(tenant, "r2", 200, 64)).reason == "kv_budget"  # 7 + 7 > 10
    settled = await admission.settle(first.reservation)
    assert (settled.blocks, settled.steady) == (3, 3)
    assert await admission.reserved_blocks("acme") == 3
    second = await admission.admit(tenant, "r2", 200, 64)  # 3 + 7 = 10: fits
    assert second.admitted and second.reservation is not None
    assert await admission.reserved_blocks("acme") == 10
    # Settling a released reservation does not bring it back.
    assert await admission.release(second.reservation)
    await admission.settle(second.reservation)
    assert await admission.reserved_blocks("acme") == 3


async def test_exactly_at_budget_then_one_block_over(
    admission: Admission, store: RedisStore
) -> None:
    tenant = quota("acme", budget=4)
    await store.put_quota(tenant)
    first = await admission.admit(tenant, "r1", prompt_tokens=32, max_tokens=16)  # 3 blocks
    assert first.admitted and first.reservation is not None and first.reservation.blocks == 3
    at_edge = await admission.admit(tenant, "r2", prompt_tokens=10, max_tokens=6)  # 1 block: 4/4
    assert at_edge.admitted
    over = await admission.admit(tenant, "r3", prompt_tokens=1, max_tokens=1)  # 5/4
    assert over.outcome is AdmissionOutcome.THROTTLED and over.reason == "kv_budget"
    assert over.retry_after_s == admission.config.throttle_retry_after_s
    assert await admission.reserved_blocks("acme") == 4
    assert first.reservation is not None
    assert await admission.release(first.reservation) is True
    assert await admission.release(first.reservation) is False  # idempotent
    assert (await admission.admit(tenant, "r3", prompt_tokens=1, max_tokens=1)).admitted


async def test_reported_usage_counts_against_the_budget(
    admission: Admission, store: RedisStore, redis: aioredis.Redis, keys: KeySpace
) -> None:
    tenant = quota("acme", budget=10)
    await store.put_quota(tenant)
    await redis.hset(keys.usage, "acme", 9)  # what the controller last measured
    assert (await admission.admit(tenant, "r1", 16, 0)).admitted  # 9 + 1 = 10
    over = await admission.admit(tenant, "r2", 32, 0)
    assert over.reason == "kv_budget"


async def test_rejections(admission: Admission, store: RedisStore) -> None:
    unknown = await admission.admit(quota("ghost"), "r1", 10, 10)
    assert (unknown.outcome, unknown.reason) == (AdmissionOutcome.REJECTED, "unknown_tenant")
    tenant = quota("acme", budget=2)
    await store.put_quota(tenant)
    too_big = await admission.admit(tenant, "r1", 48, 0)  # 3 blocks > budget 2: never fits
    assert (too_big.outcome, too_big.reason) == (AdmissionOutcome.REJECTED, "exceeds_budget")
    assert (await admission.admit(tenant, "r1", 16, 0)).admitted
    duplicate = await admission.admit(tenant, "r1", 16, 0)
    assert duplicate.reason == "duplicate_request"
    with pytest.raises(ValueError, match="request_id"):
        await admission.admit(tenant, "", 1, 1)


async def test_fifty_concurrent_admissions_respect_the_budget(
    admission: Admission, store: RedisStore
) -> None:
    tenant = quota("acme", budget=37)
    await store.put_quota(tenant)
    decisions = await asyncio.gather(
        *(admission.admit(tenant, f"req-{i}", prompt_tokens=20, max_tokens=0) for i in range(50))
    )  # 2 blocks each: at most 18 fit in 37
    admitted = [d for d in decisions if d.admitted]
    assert len(admitted) == 18
    assert all(d.reason == "kv_budget" for d in decisions if not d.admitted)
    assert await admission.reserved_blocks("acme") == 36


async def test_concurrency_limit_and_lapsed_reservations(
    admission: Admission, store: RedisStore, clock: FakeClock
) -> None:
    tenant = quota("acme", budget=100, max_concurrent_requests=2)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "a", 1, 1)).admitted
    assert (await admission.admit(tenant, "b", 1, 1)).admitted
    assert (await admission.admit(tenant, "c", 1, 1)).reason == "max_concurrent_requests"
    clock.advance(30)
    held = await admission.admit(tenant, "c", 1, 1)
    assert held.reason == "max_concurrent_requests"
    assert await admission.renew(Reservation("acme", "b", 1, 1))  # b streams on
    clock.advance(31)  # the ingress that held a died: its reservation lapses
    assert (await admission.admit(tenant, "c", 1, 1)).admitted
    assert await admission.reserved_blocks("acme") == 2
    assert not await admission.renew(Reservation("acme", "a", 1, 1))
    clock.advance(61)  # b's holder died too
    assert (await admission.admit(tenant, "d", 1, 1)).admitted
    assert await admission.reserved_blocks("acme") == 1


async def test_prompt_token_rate(admission: Admission, store: RedisStore, clock: FakeClock) -> None:
    tenant = quota("acme", budget=1000, prompt_tokens_per_s=100)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "a", 80, 1)).admitted  # bucket 100 -> 20
    throttled = await admission.admit(tenant, "b", 50, 1)
    assert throttled.reason == "prompt_token_rate"
    assert throttled.retry_after_s == pytest.approx(0.3)
    clock.advance(0.3)
    assert (await admission.admit(tenant, "b", 50, 1)).admitted


async def test_quota_change_applies_at_once(admission: Admission, store: RedisStore) -> None:
    await store.put_quota(quota("acme", budget=1))
    stale_copy = quota("acme", budget=1)
    await store.put_quota(quota("acme", budget=8))
    assert (await admission.admit(stale_copy, "a", 100, 0)).admitted  # 7 blocks fit in 8
    await store.delete_quota("acme")
    assert (await admission.admit(stale_copy, "b", 1, 0)).reason == "unknown_tenant"


async def test_admission_span_carries_tenant_and_outcome(
    redis: aioredis.Redis, keys: KeySpace, clock: FakeClock, store: RedisStore
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced = Admission(redis, clock, keys=keys, tracer=provider.get_tracer("test"))
    await store.put_quota(quota("acme", budget=1))
    await traced.admit(quota("acme", budget=1), "r1", 100, 0)
    (span,) = exporter.get_finished_spans()
    assert span.name == telemetry.SPAN_ADMISSION
    assert span.attributes is not None
    assert span.attributes[telemetry.ATTR_TENANT_ID] == "acme"
    assert span.attributes[telemetry.ATTR_ADMISSION_OUTCOME] == "rejected"
    assert span.attributes[telemetry.ATTR_ADMISSION_REASON] == "exceeds_budget"


async def test_kv_budget_retry_after_follows_the_oldest_requests_expected_finish(
    admission: Admission, store: RedisStore, clock: FakeClock, redis: aioredis.Redis, keys: KeySpace
) -> None:
    """Each held request is expected to end max_tokens x the measured time per token after
    its admission; a throttled request may retry when enough of them have ended."""
    tenant = quota("acme", budget=10)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "old", 32, 48)).admitted  # 5 blocks, ends +24 s
    clock.advance(2.0)
    assert (await admission.admit(tenant, "new", 32, 48, seconds_per_token=0.5)).admitted
    blocked = await admission.admit(tenant, "next", 32, 48, seconds_per_token=0.5)
    assert (blocked.outcome, blocked.reason) == (AdmissionOutcome.THROTTLED, "kv_budget")
    assert blocked.retry_after_s == pytest.approx(24.0 - 2.0)
    two_needed = await admission.admit(tenant, "big", 64, 96, seconds_per_token=0.5)
    assert two_needed.reason == "kv_budget"  # 10 blocks: both must end, the newer at +26 s
    assert two_needed.retry_after_s == pytest.approx(26.0 - 2.0)
    unknown_pace = await admission.admit(tenant, "next", 32, 48)
    assert unknown_pace.retry_after_s == admission.config.throttle_retry_after_s
    clock.advance(30.0)  # overdue requests: retry at the least Retry-After, not in the past
    overdue = await admission.admit(tenant, "next", 32, 48, seconds_per_token=0.5)
    assert overdue.retry_after_s == admission.config.throttle_retry_after_s
    # A release forgets the request's start as well.
    assert await admission.release(Reservation("acme", "old", 5, 5))
    assert await redis.hkeys(keys.reservation_starts("acme")) == ["new"]


async def test_kv_retry_after_counts_reported_usage_above_the_reservations(
    admission: Admission, store: RedisStore, redis: aioredis.Redis, keys: KeySpace
) -> None:
    """Replicas may report more than was reserved (a request recomputed after a preemption):
    the estimate starts from the larger of the two, as admission does."""
    tenant = quota("acme", budget=10)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "a", 16, 16)).admitted  # 2 blocks, ends +8 s
    await redis.hset(keys.usage, "acme", 9)
    blocked = await admission.admit(tenant, "b", 16, 16, seconds_per_token=0.5)
    assert blocked.reason == "kv_budget"  # max(2, 9) + 2 > 10
    assert blocked.retry_after_s == pytest.approx(8.0)  # when "a" ends: 9 - 2 + 2 <= 10
    await redis.hset(keys.usage, "acme", 20)  # more than any held request's end frees
    hopeless = await admission.admit(tenant, "b", 16, 16, seconds_per_token=0.5)
    assert hopeless.retry_after_s == admission.config.throttle_retry_after_s
