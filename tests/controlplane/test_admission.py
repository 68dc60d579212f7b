from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import telemetry
from controlplane.admission import (
    Admission,
    AdmissionConfig,
    AdmissionOutcome,
    KVBounds,
    Renewal,
    Reservation,
    kv_bounds,
)
from controlplane.admission_scripts import TAKE_PROMPT_TOKENS
from controlplane.keys import KeySpace
from controlplane.kv_bounds import SlidingWindows
from controlplane.redis_conn import RedisConfig, connect
from controlplane.retry_after import HELD_SCHEDULE_MIN_AGE_S, HeldSchedule
from controlplane.store import RedisStore
from tests.controlplane.builders import quota
from tests.redis_server import RedisServer, unique_keys


@pytest.fixture
async def admission(redis: aioredis.Redis, keys: KeySpace) -> AsyncIterator[Admission]:
    admission = Admission(redis, AdmissionConfig(block_size=16, reservation_ttl_s=60), keys)
    yield admission
    # Invariant: each tenant's running total is the sum of its held reservations.
    for key in await redis.keys(f"{keys.prefix}:resv:*"):
        await admission.check_invariants(key.rsplit(":", 1)[1])


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
    # What the policy keeps past its budget counts: 512 pinned + half of the 400 budget
    assert kv_bounds(1000, 1000, 16, None, 0.2).steady == 26
    assert kv_bounds(1000, 1000, 16, None, 0.2, protected_tokens=512, protected_fraction=0.5) == (
        KVBounds(63, 46)
    )
    assert kv_bounds(1000, 1000, 16, 64, protected_tokens=40).steady == 5  # under the cap
    assert kv_bounds(1000, 1000, 16, 64, protected_tokens=100).steady == 8
    assert kv_bounds(100, 10, 16, 64, protected_tokens=5000).steady == 7  # never above its length
    with pytest.raises(ValueError, match="prompt_tokens"):
        kv_bounds(-1, 5, 16, None)
    with pytest.raises(ValueError, match="not both 0"):
        kv_bounds(0, 0, 16, None)


def test_kv_bounds_of_n_sequences_are_n_times_one_at_its_worst_case() -> None:
    """vLLM runs each of n choices as its own request with its own KV: the prompt is held
    n times in prefill; after it, n times one sequence's worst case, because the choices
    share the prompt's blocks through the prefix cache and a block another request reads
    is never evicted (a budget would undercount the first choice's whole prompt)."""
    for args in ((10, 7, 16, None), (1000, 1000, 16, 64), (1000, 1000, 16, None, 0.5)):
        one = kv_bounds(*args)
        three = kv_bounds(*args, n=3)
        worst = kv_bounds(args[0], args[1], args[2], None)
        assert three == KVBounds(3 * one.prefill_peak, 3 * worst.steady)
    with pytest.raises(ValueError, match="n >= 1"):
        kv_bounds(10, 6, 16, None, n=0)


async def test_a_request_for_three_choices_reserves_three_sequences(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """200-token prompt, 64 new tokens, cap 48 tokens, block size 32: one sequence peaks at
    7 blocks (its prompt) and settles at 3; n=3 reserves three worst cases, 27 blocks."""
    admission = Admission(redis, AdmissionConfig(block_size=32), keys)
    tenant = quota("acme", budget=40).model_copy(update={"eviction_budget_tokens": 48})
    await store.put_quota(tenant)
    one = (await admission.admit(tenant, "one", 200, 64)).reservation
    three = (await admission.admit(tenant, "three", 200, 64, n=3)).reservation
    assert one is not None and three is not None
    assert (one.blocks, one.steady) == (7, 3)
    assert (three.blocks, three.steady) == (27, 27)
    assert await admission.reserved_blocks("acme") == 34
    # 34 + 27 > 40: a second request for three choices waits; once the single choice
    # settles (its prefill is over), another single one fits.
    assert (await admission.admit(tenant, "more", 200, 64, n=3)).reason == "kv_budget"
    await admission.settle(one)
    assert await admission.reserved_blocks("acme") == 30
    assert (await admission.admit(tenant, "fits", 200, 64)).admitted  # 30 + 7 <= 40
    # A request whose n sequences alone exceed the budget can never be held.
    too_many = await admission.admit(tenant, "never", 200, 64, n=5)  # 45 > 40
    assert (too_many.outcome, too_many.reason) == (AdmissionOutcome.REJECTED, "exceeds_budget")


async def test_a_hybrid_models_request_reserves_its_sliding_windows_too(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """200-token prompt, 64 new tokens, cap 48 tokens, block size 32, one sliding group of
    window 16 on engines scheduling 64 tokens a step (bound: ceil(79 / 32) + 1 = 4 blocks):
    7 + 4 blocks until the first token, 3 + 4 after; the window is never evicted from."""
    sliding = SlidingWindows((16,), in_flight_tokens=64, max_model_len=1024)
    admission = Admission(redis, AdmissionConfig(block_size=32, sliding=sliding), keys)
    tenant = quota("acme", budget=18).model_copy(update={"eviction_budget_tokens": 48})
    await store.put_quota(tenant)
    first = (await admission.admit(tenant, "r1", 200, 64)).reservation
    assert first is not None and (first.blocks, first.steady) == (11, 7)
    assert (await admission.admit(tenant, "r2", 200, 64)).reason == "kv_budget"  # 11 + 11
    await admission.settle(first)
    assert await admission.reserved_blocks("acme") == 7
    assert (await admission.admit(tenant, "r2", 200, 64)).admitted  # 7 + 11 = 18
    too_long = await admission.admit(tenant, "r3", 500, 64)  # 16 + 4 > 18 even alone
    assert (too_long.outcome, too_long.reason) == (AdmissionOutcome.REJECTED, "exceeds_budget")
    await admission.check_invariants("acme")


async def test_a_prompt_larger_than_the_budget_is_never_held(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Budget 10 blocks, eviction budget 48 tokens, 2,000-token prompts, block size 32: each
    prompt holds 63 blocks until its prefill ends, so none may be admitted (a reservation of
    the steady bound alone would admit five, 315 blocks against a budget of 10)."""
    admission = Admission(redis, AdmissionConfig(block_size=32), keys)
    tenant = quota("acme", budget=10).model_copy(update={"eviction_budget_tokens": 48})
    await store.put_quota(tenant)
    for index in range(5):
        decision = await admission.admit(tenant, f"r{index}", 2000, 64)
        assert (decision.outcome, decision.reason) == (AdmissionOutcome.REJECTED, "exceeds_budget")
    assert await admission.reserved_blocks("acme") == 0


async def test_reservation_shrinks_to_its_steady_bound_after_prefill(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission = Admission(redis, AdmissionConfig(block_size=32), keys)
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
    await admission.check_invariants("acme")


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
    again = await admission.admit(tenant, "r1", 16, 0)  # the same admission sent again
    assert again.admitted and await admission.reserved_blocks("acme") == 1
    duplicate = await admission.admit(tenant, "r1", 17, 0)  # another request, same id
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
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Reservations lapse on Redis's clock (0.4 s here) unless renewed."""
    admission = Admission(redis, AdmissionConfig(reservation_ttl_s=0.4), keys)
    tenant = quota("acme", budget=100, max_concurrent_requests=2)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "a", 1, 1)).admitted
    assert (await admission.admit(tenant, "b", 1, 1)).admitted
    assert (await admission.admit(tenant, "c", 1, 1)).reason == "max_concurrent_requests"
    await asyncio.sleep(0.2)
    held = await admission.admit(tenant, "c", 1, 1)
    assert held.reason == "max_concurrent_requests"
    assert await admission.renew(Reservation("acme", "b", 1, 1))  # b streams on
    await asyncio.sleep(0.3)  # the ingress that held a died: its reservation lapses
    assert (await admission.admit(tenant, "c", 1, 1)).admitted
    assert await admission.reserved_blocks("acme") == 2
    await asyncio.sleep(0.5)  # b's holder died too
    assert (await admission.admit(tenant, "d", 1, 1)).admitted
    assert await admission.reserved_blocks("acme") == 1
    await admission.check_invariants("acme")


async def test_the_concurrency_limit_counts_sequences_not_requests(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """``max_concurrent_requests`` bounds the sequences running: a request asking for
    ``n`` choices runs ``n`` (vLLM runs each as its own request); more than the limit at
    once can never be admitted. Releases and lapses give them back; a deleted tenant's
    count does not follow its re-created namesake."""
    from controlplane.tenants import remove_tenant

    admission = Admission(redis, AdmissionConfig(reservation_ttl_s=0.3), keys)
    tenant = quota("acme", budget=100, max_concurrent_requests=4)
    await store.put_quota(tenant)
    four = await admission.admit(tenant, "four", 1, 1, n=4)
    assert four.reservation is not None
    assert (await admission.admit(tenant, "one", 1, 1)).reason == "max_concurrent_requests"
    assert await admission.held_sequences("acme") == 4
    await admission.release(four.reservation)
    assert (await admission.admit(tenant, "three", 1, 1, n=3)).admitted
    assert (await admission.admit(tenant, "two", 1, 1, n=2)).reason == "max_concurrent_requests"
    too_many = await admission.admit(tenant, "five", 1, 1, n=5)
    assert (too_many.outcome, too_many.reason) == (
        AdmissionOutcome.REJECTED,
        "exceeds_max_concurrent_requests",
    )
    await admission.check_invariants("acme")
    await asyncio.sleep(0.35)  # "three" lapses: its three sequences are free again
    assert (await admission.admit(tenant, "four-again", 1, 1, n=4)).admitted
    await admission.check_invariants("acme")
    await remove_tenant(redis, keys, "acme")
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "after", 1, 1, n=4)).admitted
    assert await admission.held_sequences("acme") == 4
    await admission.check_invariants("acme")


async def test_a_renewal_reserves_again_what_lapsed_while_its_request_ran(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A renewal comes only from an ingress whose request still runs: a reservation that
    lapsed meanwhile (its renewals were late) counts again, purged or not. Once released,
    a renewal that arrives late brings nothing back."""
    admission = Admission(redis, AdmissionConfig(reservation_ttl_s=0.1), keys)
    await store.put_quota(quota("acme"))
    first = (await admission.admit(quota("acme"), "a", 1, 1)).reservation
    assert first is not None
    await asyncio.sleep(0.15)
    assert await admission.renew(first) is Renewal.RESERVED_AGAIN  # lapsed, not yet purged
    assert await admission.reserved_blocks("acme") == 1
    await asyncio.sleep(0.15)
    assert (await admission.admit(quota("acme"), "b", 16, 1)).admitted  # purges "a"
    assert await admission.reserved_blocks("acme") == 2  # "b" alone
    assert await admission.renew(first) is Renewal.RESERVED_AGAIN  # purged: reserved again
    assert await admission.reserved_blocks("acme") == 3
    assert await admission.renew(first) is Renewal.RENEWED
    assert await admission.release(first)
    assert await admission.renew(first) is Renewal.NOT_HELD  # released: never back
    assert await admission.reserved_blocks("acme") == 2
    await admission.check_invariants("acme")


async def test_prompt_token_rate(admission: Admission, store: RedisStore) -> None:
    tenant = quota("acme", budget=1000, prompt_tokens_per_s=100)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "a", 80, 1)).admitted  # bucket 100 -> 20
    throttled = await admission.admit(tenant, "b", 50, 1)
    assert throttled.reason == "prompt_token_rate"
    assert throttled.retry_after_s == pytest.approx(0.3, abs=0.02)
    await asyncio.sleep(throttled.retry_after_s + 0.02)
    assert (await admission.admit(tenant, "b", 50, 1)).admitted


async def test_deadlines_and_starts_are_on_redis_time(
    admission: Admission, store: RedisStore, redis: aioredis.Redis, keys: KeySpace
) -> None:
    """No ingress clock goes into a reservation: its deadline is Redis's TIME + the TTL."""
    await store.put_quota(quota("acme"))
    before = await admission.redis_now_s()
    assert (await admission.admit(quota("acme"), "a", 1, 7)).admitted
    after = await admission.redis_now_s()
    deadline_ms = await redis.zscore(keys.reservation_deadlines("acme"), "a")
    assert deadline_ms is not None
    assert (before + 60) * 1000 - 1 <= deadline_ms <= (after + 60) * 1000 + 1
    start = (await redis.hget(keys.reservation_starts("acme"), "a")).split()
    admitted_ms, max_tokens, prompt_tokens, steady, sequences = start
    assert before * 1000 - 1 <= int(admitted_ms) <= after * 1000 + 1 and max_tokens == "7"
    assert (prompt_tokens, steady, sequences) == ("1", "1", "1")


async def test_the_running_total_follows_admit_settle_release_and_lapse(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Admission reads one running total per tenant, never the sum of every reservation;
    every script that changes a reservation keeps it equal to that sum."""
    admission = Admission(redis, AdmissionConfig(block_size=16, reservation_ttl_s=0.3), keys)
    tenant = quota("acme", budget=100, eviction_budget_tokens=16)
    await store.put_quota(tenant)
    first = (await admission.admit(tenant, "a", 160, 8)).reservation  # peak 10, steady 2
    second = (await admission.admit(tenant, "b", 32, 0)).reservation  # 2
    assert first is not None and second is not None
    assert await admission.reserved_blocks("acme") == 12
    await admission.settle(first)
    assert await admission.reserved_blocks("acme") == 4
    assert await admission.release(second) and not await admission.release(second)
    assert await admission.reserved_blocks("acme") == 2
    await admission.check_invariants("acme")
    await asyncio.sleep(0.35)  # "a" lapses: the next admission purges it from the total
    assert (await admission.admit(tenant, "c", 16, 0)).admitted
    assert await admission.reserved_blocks("acme") == 1
    await admission.check_invariants("acme")
    assert not await admission.release(first)  # lapsed already: the total is not touched
    assert await admission.reserved_blocks("acme") == 1


async def test_the_running_total_is_what_admission_counts(
    admission: Admission, store: RedisStore, redis: aioredis.Redis, keys: KeySpace
) -> None:
    """Without a total (reservations from before it existed) admission sums them once;
    afterwards it trusts the total, not the reservations hash."""
    tenant = quota("acme", budget=10)
    await store.put_quota(tenant)
    await redis.hset(keys.reservations("acme"), mapping={"old-1": 4, "old-2": 4})
    await redis.zadd(keys.reservation_deadlines("acme"), {"old-1": 2**50, "old-2": 2**50})
    assert (await admission.admit(tenant, "a", 32, 0)).admitted  # 4 + 4 + 2 = 10
    assert await redis.get(keys.reservation_total("acme")) == "10"
    await redis.set(keys.reservation_total("acme"), 0)  # the total decides, not HVALS
    assert (await admission.admit(tenant, "b", 32, 0)).admitted
    await redis.set(keys.reservation_total("acme"), 12)
    for request_id in ("old-1", "old-2", "a", "b"):
        await admission.release(Reservation("acme", request_id, 0, 0))


async def test_quota_change_applies_at_once(admission: Admission, store: RedisStore) -> None:
    await store.put_quota(quota("acme", budget=1))
    stale_copy = quota("acme", budget=1)
    await store.put_quota(quota("acme", budget=8))
    assert (await admission.admit(stale_copy, "a", 100, 0)).admitted  # 7 blocks fit in 8
    await store.delete_quota("acme")
    assert (await admission.admit(stale_copy, "b", 1, 0)).reason == "unknown_tenant"


async def test_admission_span_carries_tenant_and_outcome(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced = Admission(redis, keys=keys, tracer=provider.get_tracer("test"))
    await store.put_quota(quota("acme", budget=1))
    await traced.admit(quota("acme", budget=1), "r1", 100, 0)
    (span,) = exporter.get_finished_spans()
    assert span.name == telemetry.SPAN_ADMISSION
    assert span.attributes is not None
    assert span.attributes[telemetry.ATTR_TENANT_ID] == "acme"
    assert span.attributes[telemetry.ATTR_ADMISSION_OUTCOME] == "rejected"
    assert span.attributes[telemetry.ATTR_ADMISSION_REASON] == "exceeds_budget"


async def test_kv_budget_retry_after_follows_the_oldest_requests_expected_finish(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Each held request is expected to end max_tokens x the measured time per token after
    its admission (on Redis's clock); a throttled request may retry when enough of them
    have ended."""
    config = AdmissionConfig(block_size=16, throttle_retry_after_s=0.01)
    admission = Admission(redis, config, keys)
    pace = 0.05  # s per token: a 48-token answer takes 2.4 s
    tenant = quota("acme", budget=10)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "old", 32, 48)).admitted  # 5 blocks, ends +2.4 s
    await asyncio.sleep(0.2)
    assert (await admission.admit(tenant, "new", 32, 48, seconds_per_token=pace)).admitted
    blocked = await admission.admit(tenant, "next", 32, 48, seconds_per_token=pace)
    assert (blocked.outcome, blocked.reason) == (AdmissionOutcome.THROTTLED, "kv_budget")
    assert blocked.retry_after_s == pytest.approx(2.4 - 0.2, abs=0.05)
    two_needed = await admission.admit(tenant, "big", 64, 96, seconds_per_token=pace)
    assert two_needed.reason == "kv_budget"  # 10 blocks: both must end, the newer at +2.6 s
    assert two_needed.retry_after_s == pytest.approx(2.6 - 0.2, abs=0.05)
    unknown_pace = await admission.admit(tenant, "next", 32, 48)
    assert unknown_pace.retry_after_s == admission.config.throttle_retry_after_s
    # A release forgets the request's start as well.
    assert await admission.release(Reservation("acme", "old", 5, 5))
    assert await redis.hkeys(keys.reservation_starts("acme")) == ["new"]
    assert await admission.release(Reservation("acme", "new", 5, 5))


async def test_kv_retry_after_counts_when_requests_in_prefill_settle(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A request reserved at its prefill peak frees most of it at its first token (it
    settles to its steady bound), long before it ends: with a measured time to first token
    the throttled request is told to come back then, not at the end."""
    config = AdmissionConfig(block_size=16, keep_ratio=0.2, throttle_retry_after_s=0.01)
    admission = Admission(redis, config, keys)
    tenant = quota("acme", budget=12)
    await store.put_quota(tenant)
    # 160-token prompt: peak 10 blocks; steady: ceil(0.2 * 256 / 16) + 1 = 5 blocks.
    assert (await admission.admit(tenant, "old", 160, 96)).admitted
    decode, first_token = 0.05, 1.6  # s per output token, s from arrival to first token
    blocked = await admission.admit(
        tenant, "next", 64, 32, seconds_per_token=decode, seconds_to_first_token=first_token
    )
    assert blocked.reason == "kv_budget"  # 10 + 4 > 12; after "old" settles: 5 + 4 <= 12
    assert blocked.retry_after_s == pytest.approx(first_token, abs=0.05)
    ends_only = await admission.admit(tenant, "next", 64, 32, seconds_per_token=decode)
    assert ends_only.retry_after_s == pytest.approx(96 * decode, abs=0.05)  # no first-token time
    # A settled request frees nothing at its first token: only its end counts (seen once
    # the parsed reservations are HELD_SCHEDULE_MIN_AGE_S old).
    await admission.settle(Reservation("acme", "old", 10, 5))
    await asyncio.sleep(HELD_SCHEDULE_MIN_AGE_S)
    too_big = await admission.admit(
        tenant, "big", 160, 0, seconds_per_token=decode, seconds_to_first_token=first_token
    )
    assert too_big.reason == "kv_budget"  # 5 + 10 > 12: "old" must end
    expected = first_token + 96 * decode - HELD_SCHEDULE_MIN_AGE_S
    assert too_big.retry_after_s == pytest.approx(expected, abs=0.05)
    assert await admission.release(Reservation("acme", "old", 5, 5))


async def test_overdue_requests_retry_at_the_least_retry_after(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    admission = Admission(redis, AdmissionConfig(block_size=16), keys)
    tenant = quota("acme", budget=5)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "old", 32, 48)).admitted  # expected to end at +0.48
    await asyncio.sleep(0.5)
    overdue = await admission.admit(tenant, "next", 32, 48, seconds_per_token=0.01)
    assert overdue.retry_after_s == admission.config.throttle_retry_after_s
    assert await admission.release(Reservation("acme", "old", 5, 5))


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
    assert blocked.retry_after_s == pytest.approx(8.0, abs=0.05)  # "a" ends: 9 - 2 + 2 <= 10
    await redis.hset(keys.usage, "acme", 20)  # more than any held request's end frees
    hopeless = await admission.admit(tenant, "b", 16, 16, seconds_per_token=0.5)
    assert hopeless.retry_after_s == admission.config.throttle_retry_after_s


def test_a_floor_lowers_the_steady_bound_only() -> None:
    assert kv_bounds(1000, 1000, 16, None, keep_ratio=0.5, floor_tokens=40) == KVBounds(63, 4)
    assert kv_bounds(1000, 1000, 16, None, keep_ratio=0.5, floor_tokens=0).steady == 1
    assert kv_bounds(10, 6, 16, None, floor_tokens=400).steady == 1  # never above its length


async def test_a_tenant_that_squeezes_to_floors_counts_its_requests_there(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Opt-in: after prefill its requests count their floor (what the policy protects plus
    a block), not their budget; other tenants keep their budget bound."""
    config = AdmissionConfig(block_size=16, keep_ratio=0.5, floor_tokens=16)
    admission = Admission(redis, config, keys)
    plain, deep = quota("plain", budget=100), quota("deep", budget=100, squeeze_to_floor=True)
    for tenant in (plain, deep):
        await store.put_quota(tenant)
    held = {}
    for tenant in (plain, deep):
        decision = await admission.admit(tenant, f"{tenant.tenant_id}-1", 320, 320)
        assert decision.reservation is not None
        held[tenant.tenant_id] = (await admission.settle(decision.reservation)).blocks
    assert held == {"plain": 21, "deep": 2}  # 0.5 x 640 = 320 tokens + a block; 16 + a block
    assert await admission.reserved_blocks("deep") == 2
    await admission.check_invariants("deep")


async def test_a_small_prompt_cannot_reset_a_bucket_in_debt(
    admission: Admission, store: RedisStore
) -> None:
    """At 10 tokens/s a 2,000-token prompt leaves the bucket 1,990 tokens in debt: neither
    another large prompt nor a small one (whose expiry once reset the bucket to full) is
    admitted until it has refilled."""
    tenant = quota("acme", budget=1000, prompt_tokens_per_s=10)
    await store.put_quota(tenant)
    assert (await admission.admit(tenant, "a", 2000, 1)).admitted
    large = await admission.admit(tenant, "b", 2000, 1)
    assert large.reason == "prompt_token_rate"
    assert large.retry_after_s == pytest.approx(200, abs=0.5)  # refill to a full bucket
    small = await admission.admit(tenant, "c", 5, 1)
    assert small.reason == "prompt_token_rate"
    assert small.retry_after_s == pytest.approx(199.5, abs=0.5)
    await asyncio.sleep(2.1)  # past what the small prompt's expiry once was
    assert not (await admission.admit(tenant, "d", 5, 1)).admitted


class ReferenceBucket:
    """The token bucket the admission script must implement, in plain Python."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.tokens, self.at_ms = capacity, 0

    def take(self, prompt: int, now_ms: int) -> int:
        tokens = min(self.capacity, self.tokens + max(0, now_ms - self.at_ms) * self.rate / 1000)
        needed = min(prompt, self.capacity)
        if tokens < needed:
            return math.ceil((needed - tokens) * 1000 / self.rate)
        self.tokens, self.at_ms = tokens - prompt, now_ms
        return 0


_TAKE_AT = (
    TAKE_PROMPT_TOKENS
    + "return take_prompt_tokens(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), "
    + "tonumber(ARGV[3]), tonumber(ARGV[4]))"
)


@settings(max_examples=60, deadline=None)
@given(
    rate=st.sampled_from([1.0, 7.5, 10.0, 250.0]),
    burst_s=st.sampled_from([0.5, 1.0, 4.0]),
    arrivals=st.lists(
        st.tuples(st.integers(0, 5_000), st.integers(1, 3_000)), min_size=1, max_size=30
    ),
)
async def test_prompt_token_bucket_matches_the_reference_model(
    redis_server: RedisServer, rate: float, burst_s: float, arrivals: list[tuple[int, int]]
) -> None:
    """The script's bucket on a real Redis, driven on a synthetic clock (the key's expiry is
    applied on that clock too: a bucket is deleted once its TTL has passed), decides and
    answers Retry-After as the reference model does for any arrival sequence."""
    client = connect(RedisConfig(url=redis_server.url))
    take = client.register_script(_TAKE_AT)
    key = f"{unique_keys().prefix}:bucket"
    reference = ReferenceBucket(rate, rate * burst_s)
    now_ms, expires_ms = 0, None
    try:
        for gap_ms, prompt in arrivals:
            now_ms += gap_ms
            if expires_ms is not None and now_ms >= expires_ms:
                await client.delete(key)  # what Redis's expiry does at this time
            wait_ms = await take(keys=[key], args=[rate, rate * burst_s, prompt, now_ms])
            assert wait_ms == reference.take(prompt, now_ms)
            ttl_ms = await client.pttl(key)
            expires_ms = now_ms + ttl_ms if ttl_ms > 0 else expires_ms
    finally:
        await client.delete(key)
        await client.aclose()


async def test_retry_after_parses_a_tenants_reservations_once_a_second(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A flood of 429s must not read and walk every held reservation each time (388 ms per
    429 at 20k reservations): one read per tenant at a time answers for a while,
    releases in between included; the committed KV is always read fresh."""
    config = AdmissionConfig(block_size=16, throttle_retry_after_s=0.01)
    admission = Admission(redis, config, keys)
    reads = 0
    read_schedule = admission._read_schedule

    async def counted(tenant_id: str, now_s: float, total: int) -> HeldSchedule:
        nonlocal reads
        reads += 1
        return await read_schedule(tenant_id, now_s, total)

    admission._read_schedule = counted  # type: ignore[method-assign]
    tenant = quota("acme", budget=2000)
    await store.put_quota(tenant)
    now_ms = int(1000 * await admission.redis_now_s())
    num_held = 2000
    await redis.hset(keys.reservations("acme"), mapping={f"r{i}": 1 for i in range(num_held)})
    starts = {f"r{i}": f"{now_ms} {10 + i} 16 1" for i in range(num_held)}
    await redis.hset(keys.reservation_starts("acme"), mapping=starts)
    await redis.set(keys.reservation_total("acme"), num_held)
    asked_s = await admission.redis_now_s()
    answers = await asyncio.gather(
        *(admission.kv_retry_after_s(tenant, 100, seconds_per_token=0.01) for _ in range(5))
    )
    assert reads == 1  # five 429s at once: one read
    shortest_100_end_s = now_ms / 1000 + (10 + 99) * 0.01  # the 100 shortest end first
    assert answers[0] == pytest.approx(shortest_100_end_s - asked_s, abs=0.05)
    # One request ended, the others' starts were rewritten: the parse answers for
    # HELD_SCHEDULE_MIN_AGE_S, with the fresh total (99 frees needed now).
    assert await admission.release(Reservation("acme", "r1999", 1, 1))
    slower = {f"r{i}": f"{now_ms} {1000 + i} 16 1" for i in range(num_held - 1)}
    await redis.hset(keys.reservation_starts("acme"), mapping=slower)
    asked_s = await admission.redis_now_s()
    cached = await admission.kv_retry_after_s(tenant, 100, seconds_per_token=0.01)
    assert reads == 1
    assert cached == pytest.approx(now_ms / 1000 + (10 + 98) * 0.01 - asked_s, abs=0.05)
    await asyncio.sleep(HELD_SCHEDULE_MIN_AGE_S)
    asked_s = await admission.redis_now_s()
    later = await admission.kv_retry_after_s(tenant, 100, seconds_per_token=0.01)
    assert reads == 2
    assert later == pytest.approx(now_ms / 1000 + (1000 + 98) * 0.01 - asked_s, abs=0.05)


async def test_an_admission_whose_reply_timed_out_is_admitted_once(
    redis_server: RedisServer, keys: KeySpace, store: RedisStore
) -> None:
    """Redis stalls 1.3 s (a slow script elsewhere) while an admission waits: the client's
    1 s socket timeout makes redis-py send the script again. It once answered
    ``duplicate_request`` (a 400) and left the first run's reservation held until its TTL;
    now the retry is the same admission, admitted once."""
    client = connect(RedisConfig(url=redis_server.url))  # production's timeout and retries
    stall = connect(RedisConfig(url=redis_server.url, socket_timeout_s=5.0))
    admission = Admission(client, AdmissionConfig(block_size=16), keys)
    tenant = quota("acme", budget=100, max_concurrent_requests=1)
    await store.put_quota(tenant)
    busy = "local t0 = redis.call('TIME')[1] while redis.call('TIME')[1] - t0 < 2 do end"
    try:
        await admission.redis_now_s()  # a connection, and the script loaded, before the stall
        stalling = asyncio.create_task(stall.eval(busy, 0))
        await asyncio.sleep(0.05)
        decision = await admission.admit(tenant, "r1", 16, 0)
        await stalling
        assert decision.admitted, decision
        assert await admission.reserved_blocks("acme") == 1
        assert await admission.held_sequences("acme") == 1
        assert decision.reservation is not None and await admission.release(decision.reservation)
        assert await admission.reserved_blocks("acme") == 0
        await admission.check_invariants("acme")
    finally:
        await client.aclose()
        await stall.aclose()


async def test_a_settle_that_finds_nothing_held_is_tried_again(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A reservation purged after lapsing is not settled by a settle that finds nothing:
    once a renewal reserves it again at its peak, the next settle shrinks it."""
    admission = Admission(redis, AdmissionConfig(block_size=16, reservation_ttl_s=0.1), keys)
    tenant = quota("acme", budget=100, eviction_budget_tokens=32)
    await store.put_quota(tenant)
    peak = (await admission.admit(tenant, "d", 512, 16, n=1)).reservation
    assert peak is not None and peak.blocks > peak.steady
    await asyncio.sleep(0.15)
    assert (await admission.admit(tenant, "e", 1, 1)).admitted  # purges "d"
    unsettled = await admission.settle(peak)
    assert unsettled == peak  # nothing held: not settled
    assert await admission.renew(peak) is Renewal.RESERVED_AGAIN
    settled = await admission.settle(unsettled)
    assert settled.blocks == peak.steady
    assert await admission.reserved_blocks("acme") == peak.steady + 1
    await admission.check_invariants("acme")


async def test_lapsed_entries_are_forgotten_after_a_ttl(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """Requests whose ingress died leave a lapsed entry each; those older than the TTL are
    forgotten at the next purge, so the record of lapses stays bounded under traffic."""
    admission = Admission(redis, AdmissionConfig(block_size=16, reservation_ttl_s=0.2), keys)
    tenant = quota("acme", budget=1000)
    await store.put_quota(tenant)
    for i in range(8):
        assert (await admission.admit(tenant, f"dead-{i}", 1, 1)).admitted
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.25)
    assert (await admission.admit(tenant, "purge", 1, 1)).admitted
    await asyncio.sleep(0.25)
    assert (await admission.admit(tenant, "purge-again", 1, 1)).admitted
    assert len(await redis.hkeys(keys.reservation_lapsed("acme"))) <= 2
    assert await redis.zcard(keys.reservation_lapsed_at("acme")) <= 2


def test_a_queue_ticket_lease_must_be_finite_and_at_most_an_hour() -> None:
    """A ticket whose ingress died holds its tenant's place until its lease ends."""
    assert AdmissionConfig(queue_ticket_ttl_s=3600.0).queue_ticket_ttl_s == 3600.0
    for ttl_s in (math.inf, 1e300, 3601.0, 0.0, math.nan):
        with pytest.raises(ValueError, match=r"queue_ticket_ttl_s must be in \(0, 3600\] s"):
            AdmissionConfig(queue_ticket_ttl_s=ttl_s)
