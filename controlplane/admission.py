"""Admission: an admitted request reserves its KV peak under its policy until it finishes.

One Lua script decides and reserves atomically, so concurrent requests from any number of
ingress processes cannot slip past a budget. A request's reservation is its peak
(:class:`KVBounds`): the whole prompt until prefill ends (or one prefill chunk plus its
budget, when the engines evict during chunked prefill and that is less), then its steady
bound; ``settle`` shrinks the reservation to the steady bound once the first token is
out. A tenant's committed KV is `max(reported active KV, sum of reservations)`: the
reservations bound the in-flight requests from above (requests in prefill at their
prefill peak, the others at their steady bound), and the controller's reported
usage covers KV the reservations do not know about. A request is admitted when
`committed + its peak <= kv_budget_blocks`, the concurrency limit has room for its ``n``
sequences (``max_concurrent_requests`` counts sequences: a request asking for ``n``
choices runs ``n``) and the
prompt-token bucket holds the prompt; a request whose peak alone exceeds the budget is
rejected (it could never be held within it).

Time is Redis's (`TIME` inside the scripts), never an ingress's wall clock: an ingress
whose clock is off cannot lapse other ingresses' reservations or refill a rate bucket
early. A reservation lapses `reservation_ttl_s` after its admission or last `renew` (a
running request renews it every third of that). The tenant's running total
(`KeySpace.reservation_total`) always equals the sum of its held reservations: admission
reads one number instead of summing them all (73 ms per admission inside Redis at 50k
live reservations of one tenant on a loaded 2-core machine; 30 us with the total).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from dataclasses import dataclass

import redis.asyncio as aioredis
from opentelemetry import trace

from controlplane import admission_scripts as scripts
from controlplane import telemetry
from controlplane.keys import KeySpace, queue_keys, reservation_keys
from controlplane.kv_bounds import NO_WINDOWS, KVBounds, SlidingWindows, kv_bounds
from controlplane.models import TenantQuota
from controlplane.retry_after import (
    MAX_CACHED_SCHEDULES,
    PARSE_INLINE_MAX,
    HeldSchedule,
)


class Renewal(enum.IntEnum):
    RENEWED = 1
    RESERVED_AGAIN = 2  # it had lapsed; its blocks count again
    NOT_HELD = 0  # released, or never admitted


class AdmissionOutcome(enum.Enum):
    ADMITTED = "admitted"
    THROTTLED = "throttled"  # retry later: HTTP 429 with Retry-After
    REJECTED = "rejected"  # never fits as asked: HTTP 4xx


DEFAULT_RESERVATION_TTL_S = 600.0
MAX_QUEUE_TICKET_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """`block_size` converts tokens to blocks; `reservation_ttl_s` bounds how long a
    reservation outlives a crashed ingress; `throttle_retry_after_s` is the Retry-After of
    concurrency throttles and the least one of budget throttles (`kv_retry_after_s`);
    `keep_ratio` is the engines' policy budget, when they hold one every step (it bounds
    requests whose tenant sets no `eviction_budget_tokens`);
    `rate_burst_s` sizes the prompt-token bucket in seconds of rate;
    `floor_tokens` is what the engines' policy keeps whatever its budget (sinks, a fixed
    recent window), when it evicts whenever asked: a tenant with `squeeze_to_floor` has its
    requests counted at that floor plus a block (`None`: no floor to count them at);
    `protected_tokens` and `protected_fraction`: what the engines' policy keeps whatever a
    request's budget `B` is, at most `protected_tokens + ceil(protected_fraction * B)`
    tokens (its sinks or the engines' pinned prefix, a fixed recent window, a recent window
    sized on the budget): a request's steady bound is never under it (:func:`kv_bounds`);
    `prefill_chunk_tokens`: the engines' prefill chunk (``max_num_batched_tokens``) when
    their policies evict during chunked prefill, so a request with a budget counts one
    chunk plus its budget until its prefill ends, if that is below its prompt (`None`: no
    chunking known, a prompt counts whole); `sliding`: a hybrid model's sliding-window
    groups, each holding up to its window beside the rest (:class:`SlidingWindows`);
    `cluster_kv_blocks`: the most blocks all tenants' reservations together may hold
    (`None`: no bound, budgets alone decide); past it requests wait in the fair queue;
    `queue_poll_s`: how often a queued request asks again; `queue_ticket_ttl_s`: how long
    its ticket outlives an ingress that stopped renewing it (:mod:`controlplane.fair_queue`)."""

    block_size: int = 16
    keep_ratio: float | None = None
    floor_tokens: int | None = None
    protected_tokens: int = 0
    protected_fraction: float = 0.0
    reservation_ttl_s: float = DEFAULT_RESERVATION_TTL_S
    throttle_retry_after_s: float = 1.0
    rate_burst_s: float = 1.0
    prefill_chunk_tokens: int | None = None
    sliding: SlidingWindows = NO_WINDOWS
    cluster_kv_blocks: int | None = None
    queue_poll_s: float = 0.1
    queue_ticket_ttl_s: float = 3.0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.reservation_ttl_s <= 0 or self.throttle_retry_after_s <= 0:
            raise ValueError("reservation_ttl_s and throttle_retry_after_s must be positive")
        if self.rate_burst_s <= 0:
            raise ValueError("rate_burst_s must be positive")
        if self.keep_ratio is not None and not 0 < self.keep_ratio <= 1:
            raise ValueError("keep_ratio must be in (0, 1]")
        if self.floor_tokens is not None and self.floor_tokens < 0:
            raise ValueError("floor_tokens must be >= 0")
        if self.protected_tokens < 0 or not 0 <= self.protected_fraction <= 1:
            raise ValueError("protected_tokens must be >= 0 and protected_fraction in [0, 1]")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if self.cluster_kv_blocks is not None and self.cluster_kv_blocks < 1:
            raise ValueError("cluster_kv_blocks must be >= 1 (None: no cluster bound)")
        if not 0 < self.queue_ticket_ttl_s <= MAX_QUEUE_TICKET_TTL_S:
            raise ValueError(
                f"queue_ticket_ttl_s must be in (0, {MAX_QUEUE_TICKET_TTL_S:g}] s: a ticket "
                "whose ingress died holds its tenant's place in the queue that long"
            )
        if not 0 < self.queue_poll_s < self.queue_ticket_ttl_s / 2:
            raise ValueError("queue_poll_s must be positive and under half queue_ticket_ttl_s")


@dataclass(frozen=True, slots=True)
class Reservation:
    """A held reservation: ``blocks`` now (the peak until settled), ``steady`` after."""

    tenant_id: str
    request_id: str
    blocks: int
    steady: int


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """`reservation` is set iff admitted; `retry_after_s` > 0 iff throttled. `reason`:
    ok, unknown_tenant, exceeds_budget, exceeds_cluster_capacity (its peak above
    ``cluster_kv_blocks``), exceeds_max_concurrent_requests (``n`` above the
    tenant's limit), duplicate_request, max_concurrent_requests, kv_budget,
    prompt_token_rate, and for the fair queue queued, cluster_full, ticket_lost.
    `queue_position`: for `queued`, how many of its tenant's tickets are ahead of it."""

    outcome: AdmissionOutcome
    reason: str
    retry_after_s: float
    reservation: Reservation | None
    queue_position: int = 0

    @property
    def admitted(self) -> bool:
        return self.outcome is AdmissionOutcome.ADMITTED


class Admission:
    """Admit or throttle requests against tenant quotas stored in Redis."""

    def __init__(
        self,
        redis: aioredis.Redis,
        config: AdmissionConfig | None = None,
        keys: KeySpace | None = None,
        tracer: trace.Tracer = telemetry.NOOP_TRACER,
    ) -> None:
        self.config = config if config is not None else AdmissionConfig()
        self.keys = keys if keys is not None else KeySpace()
        self._redis = redis
        self._tracer = tracer
        self._admit = redis.register_script(scripts.ADMIT)
        self._settle = redis.register_script(scripts.SETTLE)
        self._release = redis.register_script(scripts.RELEASE)
        self._renew = redis.register_script(scripts.RENEW)
        self._held: dict[str, HeldSchedule] = {}  # tenant -> its held reservations, parsed
        self._reading: dict[str, asyncio.Future[HeldSchedule]] = {}  # reads in flight

    async def admit(
        self,
        quota: TenantQuota,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        seconds_per_token: float | None = None,
        n: int = 1,
        seconds_to_first_token: float | None = None,
        ticket: str = "",
    ) -> AdmissionDecision:
        """Reserve the request's KV peak, or say why not (for all ``n`` sequences of a
        request asking for ``n`` choices: :func:`kv_bounds`).

        ``seconds_per_token`` (the measured time per output token, ``None`` when unknown)
        and ``seconds_to_first_token`` (the measured time from arrival to first token) let a
        ``kv_budget`` throttle say when enough of the tenant's running requests will have
        settled or finished (:meth:`kv_retry_after_s`).

        ``ticket``: the request's ticket in the fair queue (:mod:`controlplane.fair_queue`),
        empty for a request not queued. A request waits (throttled ``queued``) while a
        ticket of its tenant is ahead of it, and ``cluster_full`` while the cluster's
        capacity or another tenant's turn holds it back; a ticket admitted leaves the queue.
        A request that can never be admitted as asked (its peak above its tenant's budget or
        the cluster's capacity, ``n`` above its concurrency limit) is rejected at once,
        queued or not: waiting would not make it fit.

        `quota` is the caller's (possibly cached) copy; the script re-reads the stored one,
        so an admin change applies at once and a deleted tenant is rejected.
        """
        if not request_id:
            raise ValueError("request_id must be non-empty")
        bounds = self.bounds(quota, prompt_tokens, max_tokens, n)
        blocks = bounds.peak
        tenant_id = quota.tenant_id
        with self._tracer.start_as_current_span(telemetry.SPAN_ADMISSION) as span:
            span.set_attribute(telemetry.ATTR_TENANT_ID, tenant_id)
            span.set_attribute(telemetry.ATTR_RESERVED_BLOCKS, blocks)
            outcome, reason, retry_after_ms, *position = await self._admit(
                keys=self._admit_keys(tenant_id),
                args=[
                    tenant_id,
                    request_id,
                    blocks,
                    int(self.config.reservation_ttl_s * 1000),
                    prompt_tokens,
                    self.config.rate_burst_s,
                    max_tokens,
                    bounds.steady,
                    n,
                    ticket,
                    self.config.cluster_kv_blocks or 0,
                    int(self.config.queue_ticket_ttl_s * 1000),
                    self.keys.reservation_total(""),
                ],
            )
            if reason == "kv_budget":
                retry_after_s = await self.kv_retry_after_s(
                    quota, blocks, seconds_per_token, seconds_to_first_token
                )
                retry_after_ms = int(1000 * retry_after_s)
            decision = self._decision(
                Reservation(tenant_id, request_id, blocks, bounds.steady),
                outcome,
                reason,
                retry_after_ms,
            )
            if position:
                decision = dataclasses.replace(decision, queue_position=int(position[0]))
            span.set_attribute(telemetry.ATTR_ADMISSION_OUTCOME, decision.outcome.value)
            span.set_attribute(telemetry.ATTR_ADMISSION_REASON, decision.reason)
            span.set_attribute(telemetry.ATTR_RETRY_AFTER_S, decision.retry_after_s)
            return decision

    def bounds(self, quota: TenantQuota, prompt_tokens: int, max_tokens: int, n: int) -> KVBounds:
        """The request's :func:`kv_bounds` under this admission's config and ``quota``."""
        return kv_bounds(
            prompt_tokens,
            max_tokens,
            self.config.block_size,
            quota.eviction_budget_tokens,
            self.config.keep_ratio,
            n=n,
            floor_tokens=self.config.floor_tokens if quota.squeeze_to_floor else None,
            protected_tokens=self.config.protected_tokens,
            protected_fraction=self.config.protected_fraction,
            prefill_chunk_tokens=self.config.prefill_chunk_tokens,
            sliding=self.config.sliding,
        )

    def _admit_keys(self, tenant_id: str) -> list[str]:
        """The admission script's KEYS, in its order (``admission_scripts.ADMIT``)."""
        keys = self.keys
        return [
            *reservation_keys(keys, tenant_id),
            *queue_keys(keys, tenant_id),
            keys.queue_counters,
            keys.queue_virtual_time,
            keys.queue_present_weights,
        ]

    def _decision(
        self, reservation: Reservation, outcome: str, reason: str, ms: int
    ) -> AdmissionDecision:
        kind = AdmissionOutcome(outcome)
        if kind is AdmissionOutcome.ADMITTED:
            return AdmissionDecision(kind, reason, 0.0, reservation)
        if kind is AdmissionOutcome.THROTTLED:
            retry_after_s = self.config.throttle_retry_after_s if ms < 0 else ms / 1000
            return AdmissionDecision(kind, reason, retry_after_s, None)
        return AdmissionDecision(kind, reason, 0.0, None)

    async def settle(self, reservation: Reservation) -> Reservation:
        """Prefill is over: shrink a held reservation to its steady bound (a no-op when it
        was released or lapsed, or is already there). Returns the reservation as held."""
        if reservation.blocks <= reservation.steady:
            return reservation
        tenant_id = reservation.tenant_id
        settled = await self._settle(
            keys=[
                self.keys.reservations(tenant_id),
                self.keys.reservation_total(tenant_id),
                self.keys.cluster_reservation_total,
            ],
            args=[reservation.request_id, reservation.steady],
        )
        if not settled:  # not held now (lapsed, or released): a later call settles it
            return reservation
        return Reservation(
            reservation.tenant_id, reservation.request_id, reservation.steady, reservation.steady
        )

    async def release(self, reservation: Reservation) -> bool:
        """Return a finished request's reservation; idempotent, True if it was held.
        Raises Redis errors (:class:`controlplane.releases.Releaser` retries them)."""
        tenant_id = reservation.tenant_id
        removed = await self._release(
            keys=[
                self.keys.reservations(tenant_id),
                self.keys.reservation_deadlines(tenant_id),
                self.keys.reservation_starts(tenant_id),
                self.keys.reservation_total(tenant_id),
                self.keys.reservation_sequences(tenant_id),
                self.keys.reservation_lapsed(tenant_id),
                self.keys.reservation_lapsed_at(tenant_id),
                self.keys.cluster_reservation_total,
            ],
            args=[reservation.request_id],
        )
        return bool(removed)

    async def kv_retry_after_s(
        self,
        quota: TenantQuota,
        blocks: int,
        seconds_per_token: float | None,
        seconds_to_first_token: float | None = None,
    ) -> float:
        """When a request of ``blocks`` should fit the tenant's budget. Each held request
        frees blocks twice: its first token is expected ``seconds_to_first_token`` after
        its admission (the measured mean: queueing and prefill), when a reservation still
        at its prefill peak settles to its steady bound; it ends ``max_tokens *
        seconds_per_token`` later and frees the rest. Walk these events in time order
        until the committed KV (``max(reserved, reported)``) plus ``blocks`` fits. Without
        a first-token time the first token is taken at admission and only ends count.
        Within ``[throttle_retry_after_s, reservation_ttl_s]``; ``throttle_retry_after_s``
        when the pace is unknown or the held requests' ends do not make room."""
        floor, ceiling = self.config.throttle_retry_after_s, self.config.reservation_ttl_s
        if seconds_per_token is None or seconds_per_token <= 0:
            return floor
        tenant_id = quota.tenant_id
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.get(self.keys.reservation_total(tenant_id))
            pipe.hget(self.keys.usage, tenant_id)
            (seconds, microseconds), total, reported = await pipe.execute()
        now = seconds + microseconds / 1e6
        schedule = await self._held_schedule(tenant_id, now, int(total or 0))
        excess = max(int(total or 0), int(reported or 0)) + blocks - quota.kv_budget_blocks
        at_s = schedule.room_at_s(excess, seconds_per_token, seconds_to_first_token)
        return floor if at_s is None else min(max(at_s - now, floor), ceiling)

    async def _held_schedule(self, tenant_id: str, now_s: float, total: int) -> HeldSchedule:
        """The tenant's parsed reservations (:data:`HELD_SCHEDULE_MIN_AGE_S`), read by one
        caller at a time (the others await its read)."""
        cached = self._held.get(tenant_id)
        if cached is not None and cached.current(total, now_s):
            return cached
        reading = self._reading.get(tenant_id)
        if reading is None:
            reading = asyncio.ensure_future(self._read_schedule(tenant_id, now_s, total))
            self._reading[tenant_id] = reading
            reading.add_done_callback(lambda _: self._reading.pop(tenant_id, None))
        return await asyncio.shield(reading)

    async def _read_schedule(self, tenant_id: str, now_s: float, total: int) -> HeldSchedule:
        held: dict[str, str] = await self._redis.hgetall(self.keys.reservations(tenant_id))  # type: ignore[assignment]
        starts: dict[str, str] = await self._redis.hgetall(  # type: ignore[assignment]
            self.keys.reservation_starts(tenant_id)
        )
        if len(held) < PARSE_INLINE_MAX:
            schedule = HeldSchedule.parse(held, starts, now_s, total)
        else:  # tens of ms at 20k reservations: off the event loop
            schedule = await asyncio.to_thread(HeldSchedule.parse, held, starts, now_s, total)
        self._held[tenant_id] = schedule
        while len(self._held) > MAX_CACHED_SCHEDULES:
            self._held.pop(next(iter(self._held)))
        return schedule

    async def redis_now_s(self) -> float:
        """Redis's clock (`TIME`), the one admission times reservations with."""
        seconds, microseconds = await self._redis.time()
        return seconds + microseconds / 1e6

    async def renew(self, reservation: Reservation) -> Renewal:
        """Push a held reservation's deadline to Redis's now + `reservation_ttl_s` (running
        requests call this every third of it). One that lapsed (its ingress could not
        renew in time) is reserved again at the blocks it held: its request still runs."""
        tenant_id = reservation.tenant_id
        renewed = await self._renew(
            keys=[
                self.keys.reservation_deadlines(tenant_id),
                self.keys.reservations(tenant_id),
                self.keys.reservation_lapsed(tenant_id),
                self.keys.reservation_total(tenant_id),
                self.keys.reservation_starts(tenant_id),
                self.keys.reservation_sequences(tenant_id),
                self.keys.reservation_lapsed_at(tenant_id),
                self.keys.cluster_reservation_total,
            ],
            args=[reservation.request_id, int(self.config.reservation_ttl_s * 1000)],
        )
        return Renewal(int(renewed))

    async def reserved_blocks(self, tenant_id: str) -> int:
        """The tenant's running reservation total (lapsed ones included until next admit);
        before its first admission, the sum of whatever is held."""
        total = await self._redis.get(self.keys.reservation_total(tenant_id))
        if total is not None:
            return int(total)
        values = await self._redis.hvals(self.keys.reservations(tenant_id))
        return sum(int(value) for value in values)

    async def held_sequences(self, tenant_id: str) -> int:
        """The sequences the tenant's held reservations run (what
        ``max_concurrent_requests`` bounds); 0 before its first admission."""
        held = await self._redis.hkeys(self.keys.reservations(tenant_id))
        if not held:
            return 0
        return int(await self._redis.get(self.keys.reservation_sequences(tenant_id)) or 0)

    async def check_invariants(self, tenant_id: str) -> None:
        """The running total equals the sum of the held reservations, the sequence count
        the sum of their ``n`` (while any is held), every held reservation has a deadline,
        and none is negative (tests call this)."""
        held = await self._redis.hgetall(self.keys.reservations(tenant_id))
        starts = await self._redis.hgetall(self.keys.reservation_starts(tenant_id))
        fields = [(starts.get(request_id) or "").split() for request_id in held]
        sequences = sum(int(start[4]) if len(start) > 4 else 1 for start in fields)
        assert await self.held_sequences(tenant_id) == sequences, (sequences, starts)
        total = await self._redis.get(self.keys.reservation_total(tenant_id))
        deadlines = await self._redis.zrange(self.keys.reservation_deadlines(tenant_id), 0, -1)
        blocks = [int(value) for value in held.values()]
        assert all(b >= 0 for b in blocks), held
        assert int(total or 0) == sum(blocks), (total, held)
        assert set(held) <= set(deadlines), (held, deadlines)
