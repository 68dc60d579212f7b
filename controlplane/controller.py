"""The controller loop: reports + quotas -> routing plan, usage and eviction pressure.

One controller leads at a time (`ControllerLease`); standbys loop too and take over when
the lease lapses, resuming from the plan stored in Redis. When Redis is away or refuses
writes (any `RedisError`, `OutOfMemoryError` and `ReadOnlyError` included) the loop keeps
its last plan (`current_plan`), backs off and retries; quotas live in Redis
(the controller only caches them per version), so nothing is lost across an outage.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from opentelemetry import trace

from controlplane import telemetry
from controlplane.admission import DEFAULT_RESERVATION_TTL_S
from controlplane.clock import Clock
from controlplane.lapse_sweep import sweep_lapsed
from controlplane.lease import ControllerLease, LeaseHeld, PlanWrite
from controlplane.models import RoutingPlan, TenantQuota
from controlplane.placement import PlanInputs, PlannerConfig, PlanResult, compute_plan
from controlplane.plan_slices import SliceUpdate, slice_update
from controlplane.redis_conn import REDIS_ERRORS, Backoff
from controlplane.store import RedisStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """`report_max_age_s`: a report older than this is stale and its replica is drained
    (replicas report every ~0.1 s); `forget_after_s`: a replica silent this long is no
    longer listed at all. `lease_ttl_s` must exceed `period_s` so the leader renews in
    time; a standby takes over at most `lease_ttl_s` after the leader dies. Every
    `lapse_sweep_cycles` leader cycles the tenants' lapsed reservations are purged
    (`controlplane.lapse_sweep`; `reservation_ttl_s` is the ingresses'). `usage_ttl_s`:
    the per-tenant usage admission reads expires this long after the last plan write, so
    a stopped controller leaves no frozen numbers behind (it must exceed `period_s`)."""

    period_s: float = 0.5
    lease_ttl_s: float = 2.0
    usage_ttl_s: float = 5.0
    report_max_age_s: float = 0.5
    forget_after_s: float = 60.0
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 2.0
    freeze_gc_after_cycle: bool = True
    gc_full_collect_cycles: int = 120
    quota_full_read_cycles: int = 20
    lapse_sweep_cycles: int = 20
    reservation_ttl_s: float = DEFAULT_RESERVATION_TTL_S

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.report_max_age_s <= 0:
            raise ValueError("period_s and report_max_age_s must be positive")
        if self.lease_ttl_s <= self.period_s:
            raise ValueError(f"lease_ttl_s ({self.lease_ttl_s}) must exceed period_s")
        if self.usage_ttl_s <= self.period_s:
            raise ValueError(f"usage_ttl_s ({self.usage_ttl_s}) must exceed period_s")
        if self.forget_after_s < self.report_max_age_s:
            raise ValueError("forget_after_s must be >= report_max_age_s")
        if min(self.quota_full_read_cycles, self.gc_full_collect_cycles) < 1:
            raise ValueError("quota_full_read_cycles and gc_full_collect_cycles must be >= 1")
        if self.lapse_sweep_cycles < 1 or self.reservation_ttl_s <= 0:
            raise ValueError("lapse_sweep_cycles must be >= 1, reservation_ttl_s positive")


@dataclass(frozen=True, slots=True)
class CycleResult:
    """What one controller cycle did. `plan` is the plan now current for this process
    (written this cycle by a leader, or read from Redis by a standby); `write` is None for
    a standby."""

    leader: bool
    plan: RoutingPlan | None
    write: PlanWrite | None
    num_moves: int = 0
    read_s: float = 0.0  # quotas + reports from Redis
    plan_s: float = 0.0  # compute_plan
    write_s: float = 0.0  # fenced plan write


class Controller:
    def __init__(
        self,
        store: RedisStore,
        lease: ControllerLease,
        clock: Clock,
        config: ControllerConfig | None = None,
        planner_config: PlannerConfig | None = None,
        tracer: trace.Tracer = telemetry.NOOP_TRACER,
        on_cycle: Callable[[CycleResult], None] | None = None,
    ) -> None:
        """``on_cycle`` sees every leader cycle's result (its timings: metrics)."""
        self.config = config if config is not None else ControllerConfig()
        self._on_cycle = on_cycle
        self.planner_config = planner_config if planner_config is not None else PlannerConfig()
        self._store = store
        self._lease = lease
        self._clock = clock
        self._tracer = tracer
        self._plan: RoutingPlan | None = None
        self._fence: int | None = None
        self._next_version = 0
        self._stored_is_current = False  # whether Redis holds self._plan's content
        self._quotas: dict[str, TenantQuota] = {}
        self._quotas_version: int | None = None
        self._cycles_since_quota_read = 0
        self._cycles_since_full_gc = 0
        self._cycles_since_sweep = 0

    @property
    def current_plan(self) -> RoutingPlan | None:
        """The last plan this controller wrote or read; kept while Redis is away."""
        return self._plan

    @property
    def quotas(self) -> Mapping[str, TenantQuota]:
        """The quotas the last leader cycle planned with (kept while Redis is away)."""
        return self._quotas

    @property
    def is_leader(self) -> bool:
        return self._fence is not None

    async def step(self) -> CycleResult:
        """One cycle. Raises Redis connection errors; `run` handles them."""
        with self._tracer.start_as_current_span(telemetry.SPAN_CONTROLLER_CYCLE) as span:
            state = await self._lease.acquire_or_renew()
            if not isinstance(state, LeaseHeld):
                self._fence = None
                await self._follow()
                return CycleResult(leader=False, plan=self._plan, write=None)
            if state.fence != self._fence:
                await self._resume(state.fence)
            span.set_attribute(telemetry.ATTR_LEASE_FENCE, state.fence)
            result = await self._plan_and_write(state.fence, span)
            await self._sweep_lapsed()
            if self._on_cycle is not None:
                self._on_cycle(result)
            return result

    async def _follow(self) -> None:
        """As a standby, keep the leader's latest plan (read only when its version moved)."""
        head = await self._store.read_plan_head()
        if head.version is None:
            return
        if self._plan is not None and self._plan.version == head.version:
            if head.heartbeat_s is not None and head.heartbeat_s > self._plan.created_s:
                # The leader still plans the same content: as fresh as its heartbeat.
                self._plan = self._plan.model_copy(update={"created_s": head.heartbeat_s})
            return
        plan = await self._read_stored_plan()
        if plan is not None:
            self._plan = plan

    async def _resume(self, fence: int) -> None:
        """Newly leading: continue from the stored plan so versions keep growing."""
        stored_version = await self._store.read_plan_version()
        stored = await self._read_stored_plan()
        if stored is not None and (self._plan is None or stored.version >= self._plan.version):
            self._plan = stored
        last = max(
            self._plan.version if self._plan is not None else -1,
            stored_version if stored_version is not None else -1,
        )
        self._next_version = max(self._next_version, last + 1)
        self._fence = fence
        self._stored_is_current = False  # the first plan under this fence is written whole
        logger.info("controller %s leads with fence %d", self._lease.owner, fence)

    async def _read_stored_plan(self) -> RoutingPlan | None:
        """The stored plan; None (logged) if it does not validate, e.g. written by an
        incompatible version: the leader then plans from scratch, a standby keeps its own."""
        try:
            return await self._store.read_plan()
        except ValueError as error:
            logger.error("controller: stored plan is invalid, ignoring it: %s", error)
            return None

    async def _plan_and_write(self, fence: int, span: trace.Span) -> CycleResult:
        started = time.perf_counter()
        now_s = self._clock.now()
        quotas = await self._read_quotas()
        snapshot = await self._store.read_reports(
            now_s, self.config.report_max_age_s, self.config.forget_after_s
        )
        read_done = time.perf_counter()
        inputs = PlanInputs(
            version=self._next_version,
            fence=fence,
            now_s=now_s,
            reports=snapshot.fresh,
            stale_ids=snapshot.stale_ids,
            quotas=quotas,
            previous=self._plan,
        )
        with self._tracer.start_as_current_span(telemetry.SPAN_PLAN_COMPUTE):
            # ~0.1 s of CPU at 1000 replicas x 10000 tenants: off the event loop.
            result, changed, slices = await asyncio.to_thread(self._compute, inputs)
        plan = result.plan
        if not changed and self._plan is not None:  # same content: the version stays
            plan = self._plan.model_copy(update={"fence": fence, "created_s": now_s})
        plan_done = time.perf_counter()
        with self._tracer.start_as_current_span(telemetry.SPAN_PLAN_WRITE):
            write = await self._lease.write_plan(
                plan, result.usage_blocks, self.config.usage_ttl_s, changed, slices
            )
        timings = {
            "read_s": read_done - started,
            "plan_s": plan_done - read_done,
            "write_s": time.perf_counter() - plan_done,
        }
        span.set_attribute(telemetry.ATTR_PLAN_VERSION, result.plan.version)
        span.set_attribute(telemetry.ATTR_NUM_REPLICAS, len(result.plan.replica_ids))
        span.set_attribute(telemetry.ATTR_NUM_TENANTS, len(result.plan.tenants))
        span.set_attribute(telemetry.ATTR_NUM_MOVES, result.num_moves)
        span.set_attribute(telemetry.ATTR_NUM_DRAINED, len(result.plan.drained_replica_ids))
        num_moves = result.num_moves
        if write is PlanWrite.WRITTEN:
            self._plan = plan
            self._next_version = max(self._next_version, plan.version + 1)
            self._stored_is_current = True
            self._tune_gc()
            return CycleResult(True, self._plan, write, num_moves, **timings)
        if write is PlanWrite.PLAN_MISSING:  # Redis lost it: write it whole next cycle
            self._stored_is_current = False
            logger.warning("controller %s: the stored plan is gone, rewriting", self._lease.owner)
            return CycleResult(True, self._plan, write, 0, **timings)
        self._stored_is_current = False
        if write is PlanWrite.STALE_VERSION:
            stored = await self._store.read_plan_version()
            self._next_version = max(self._next_version, (stored or 0) + 1)
        else:
            self._fence = None  # lost the lease between renew and write
        logger.warning("controller %s plan write refused: %s", self._lease.owner, write.value)
        return CycleResult(write is PlanWrite.STALE_VERSION, self._plan, write, 0, **timings)

    async def _sweep_lapsed(self) -> None:
        self._cycles_since_sweep += 1
        if self._cycles_since_sweep < self.config.lapse_sweep_cycles:
            return
        self._cycles_since_sweep = 0
        store = self._store
        ttl_s = self.config.reservation_ttl_s
        await sweep_lapsed(store.redis, store.keys, self._quotas, ttl_s)

    def _compute(self, inputs: PlanInputs) -> tuple[PlanResult, bool, SliceUpdate]:
        """The plan, whether its content differs from the stored one's (always when the
        stored plan may not be this controller's last one), and the replicas' slices
        to write (those that changed; all of them when the stored ones are not known)."""
        result = compute_plan(inputs, self.planner_config)
        previous = self._plan if self._stored_is_current else None
        changed = previous is None or not result.plan.same_content(previous)
        return result, changed, slice_update(result.plan, previous)

    def _tune_gc(self) -> None:
        if not self.config.freeze_gc_after_cycle:
            return
        self._cycles_since_full_gc += 1
        if self._cycles_since_full_gc >= self.config.gc_full_collect_cycles:
            gc.unfreeze()
            gc.collect()
            self._cycles_since_full_gc = 0
        gc.freeze()

    async def _read_quotas(self) -> dict[str, TenantQuota]:
        """The quotas, re-read only when they changed (or every N cycles, in case Redis
        lost its data and the version counter restarted)."""
        version = await self._store.read_quotas_version()
        self._cycles_since_quota_read += 1
        if (
            version != self._quotas_version
            or self._cycles_since_quota_read >= self.config.quota_full_read_cycles
        ):
            self._quotas = await self._store.list_quotas()
            self._quotas_version = version
            self._cycles_since_quota_read = 0
        return self._quotas

    async def run(self, stop: asyncio.Event) -> None:
        """Loop every `period_s` until `stop` is set; Redis errors back off and retry."""
        backoff = Backoff(self.config.backoff_base_s, self.config.backoff_cap_s)
        while not stop.is_set():
            try:
                await self.step()
            except REDIS_ERRORS as error:  # unreachable, OOM, read-only: all survivable
                delay = backoff.next_delay_s()
                logger.warning(
                    "controller: Redis error (%s: %s); retry in %.2fs",
                    type(error).__name__,
                    error,
                    delay,
                )
                await self._clock.sleep(delay)
                continue
            except Exception:  # noqa: BLE001 - a bad record must not end the loop
                delay = backoff.next_delay_s()
                logger.exception("controller: cycle failed; retry in %.2fs", delay)
                await self._clock.sleep(delay)
                continue
            backoff.reset()
            await self._clock.sleep(self.config.period_s)

    async def shutdown(self) -> None:
        """Release the lease (if held) so a standby takes over without waiting."""
        if self._fence is not None:
            await self._lease.release(self._fence)
            self._fence = None
