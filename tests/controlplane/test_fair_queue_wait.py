"""The fair queue's expected waits on a real redis-server: a tenant's pace (the time its
tickets spend first in its queue), the wait it predicts for a ticket, the refusal at
joining of a ticket expected past its tenant's ``max_queue_wait_s``, and the pace's
bookkeeping (a first ticket leaving, the queue emptying, the tenant removed)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from controlplane.admission import Admission
from controlplane.fair_queue import FairQueue
from controlplane.keys import KeySpace
from controlplane.models import TenantQuota
from controlplane.store import RedisStore
from controlplane.tenants import remove_tenant
from tests.controlplane.builders import quota
from tests.controlplane.test_fair_queue import MAX_TOKENS, PROMPT, ask, make, release

FIRST_S = 0.4  # how long the first measured ticket is held first in its queue


async def pace_s(redis: aioredis.Redis, keys: KeySpace, tenant_id: str) -> float | None:
    """The tenant's pace as Redis holds it (``None``: no entry, or none measured)."""
    raw = await redis.hget(keys.queue_paces, tenant_id)
    if raw is None:
        return None
    pace_ms = float(raw.split()[0])
    return None if pace_ms < 0 else pace_ms / 1000


async def backlog(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore, tickets: int
) -> tuple[Admission, FairQueue, TenantQuota, float]:
    """A cluster holding one request, held by another tenant; ``acme`` queues ``tickets``
    tickets, its first is admitted ``FIRST_S`` later: its pace (returned) is measured."""
    admission, queue = await make(redis, keys)
    acme, holder = quota("acme", 10_000), quota("holder", 10_000)
    for tenant in (acme, holder):
        await store.put_quota(tenant)
    assert (await admission.admit(holder, "held", PROMPT, MAX_TOKENS)).admitted
    joined = time.monotonic()
    for index in range(tickets):
        assert (await queue.enqueue(acme, f"t-{index}")).queued
    assert await pace_s(redis, keys, "acme") is None  # none admitted yet
    await asyncio.sleep(FIRST_S)
    await release(admission, holder, "held")
    assert await ask(admission, acme, "t-0") == "admitted"
    first_s = time.monotonic() - joined
    pace = await pace_s(redis, keys, "acme")
    assert pace is not None and pace == pytest.approx(first_s, abs=0.05)
    return admission, queue, acme, pace


async def test_a_ticket_expected_past_the_maximum_is_refused_at_joining(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """With a pace ``p`` and a first ticket just made first, a ticket joining behind ``k``
    is expected to wait about ``(k + 1) p``: with the maximum at 2.5 paces, the second
    ticket behind the first joins and the third is refused, told how long it would wait;
    the queue stays as it was."""
    admission, queue, acme, pace = await backlog(redis, keys, store, tickets=2)
    limited = acme.model_copy(update={"max_queue_wait_s": 2.5 * pace})
    joined = await queue.enqueue(limited, "t-2")  # one ahead: about 2 paces
    assert joined.queued and joined.expected_wait_s == pytest.approx(2 * pace, abs=0.05)
    refused = await queue.enqueue(limited, "t-3")  # two ahead: about 3 paces
    assert (refused.queued, refused.too_long, refused.depth) == (False, True, 2)
    assert refused.expected_wait_s == pytest.approx(3 * pace, abs=0.05)
    assert (await queue.queues())["acme"].depth == 2
    # With a maximum it fits it joins; the depth bound still refuses first (not too_long).
    roomy = acme.model_copy(update={"max_queue_wait_s": 10 * pace, "max_queue_depth": 3})
    assert (await queue.enqueue(roomy, "t-3")).queued
    full = await queue.enqueue(roomy, "t-4")
    assert (full.queued, full.too_long) == (False, False)
    await queue.check_invariants()
    # A queued ticket's poll says what it is expected to wait still.
    decision = await admission.admit(acme, "t-3", PROMPT, MAX_TOKENS, ticket="t-3")
    assert (decision.reason, decision.queue_position) == ("queued", 2)
    assert decision.queue_expected_wait_s == pytest.approx(3 * pace, abs=0.1)


async def test_a_first_ticket_there_longer_than_the_pace_slows_the_expected_waits(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """The first ticket stays first for four paces: the expected wait of a ticket joining
    behind one counts it as if admitted now (with one time measured, the mean of the two)
    instead of the stale pace."""
    _, queue, _, pace = await backlog(redis, keys, store, tickets=2)
    fresh = await queue.expected_wait_s("acme")
    assert fresh == pytest.approx(2 * pace, abs=0.05)
    started = time.monotonic()
    await asyncio.sleep(4 * pace)
    first_for = time.monotonic() - started
    slowed = await queue.expected_wait_s("acme")
    assert slowed == pytest.approx((pace + first_for) / 2, abs=0.05)
    assert slowed is not None and slowed > 2 * pace  # not the stale estimate


async def test_a_first_ticket_that_leaves_makes_the_next_one_first_from_then(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    _, queue, _, pace = await backlog(redis, keys, store, tickets=3)
    await asyncio.sleep(2 * pace)  # t-1 first for two paces: as if admitted now, 1.5 paces
    assert await queue.expected_wait_s("acme") == pytest.approx(2 * (1.5 * pace), abs=0.1)
    assert await queue.leave("acme", "t-1")  # t-2 is first now, with a whole pace to go
    assert await queue.expected_wait_s("acme") == pytest.approx(2 * pace, abs=0.05)
    await queue.check_invariants()


async def test_the_pace_belongs_to_one_backlog(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """When the tenant's queue empties its pace goes: the next backlog joins on no
    evidence (the maximum still bounds its waits) until a ticket of it is admitted."""
    admission, queue, acme, _ = await backlog(redis, keys, store, tickets=2)
    await release(admission, acme, "t-0")
    assert await ask(admission, acme, "t-1") == "admitted"
    assert await pace_s(redis, keys, "acme") is None
    assert not await redis.hexists(keys.queue_paces, "acme")
    tight = acme.model_copy(update={"max_queue_wait_s": 0.001})
    for index in range(3):  # no pace: nothing is expected, nothing refused so
        joined = await queue.enqueue(tight, f"u-{index}")
        assert joined.queued and joined.expected_wait_s is None
    await release(admission, acme, "t-1")
    await remove_tenant(redis, keys, "acme")
    assert not await redis.hexists(keys.queue_paces, "acme")


async def test_the_first_times_are_averaged_alike_then_each_weighs_a_quarter(
    redis: aioredis.Redis, keys: KeySpace, store: RedisStore
) -> None:
    """A slow start does not dominate: the second time first is averaged with the first
    one alike; from the fifth on, each new time moves the pace by a quarter."""
    admission, _, acme, first = await backlog(redis, keys, store, tickets=7)
    times = [first]
    for index in range(1, 6):  # t-1 .. t-5 are each first for a short while
        started = time.monotonic()
        await release(admission, acme, f"t-{index - 1}")
        assert await ask(admission, acme, f"t-{index}") == "admitted"
        times.append(time.monotonic() - started)
        if index == 1:
            assert await pace_s(redis, keys, "acme") == pytest.approx(sum(times) / 2, abs=0.03)
    expected = sum(times[:4]) / 4
    for later in times[4:]:
        expected += (later - expected) / 4
    assert await pace_s(redis, keys, "acme") == pytest.approx(expected, abs=0.03)
    assert expected < first / 2  # the slow first time is mostly forgotten
    await release(admission, acme, "t-5")
