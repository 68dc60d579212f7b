"""The replica report publisher: engine counters -> Redis every ~100 ms.

Engine-agnostic: it takes a callable that returns the engine's `EngineCounters` (read
a few integers the engine already keeps; it must not block or take locks the engine
holds for long). Publishing never blocks the engine loop: the Redis write is async with
a timeout below one period, a failed or slow write is dropped (the next report replaces
it anyway) and the publisher backs off while Redis is away or refuses writes (every
`RedisError`: a lost connection, `OutOfMemoryError` at `maxmemory`, `ReadOnlyError` after a
failover). Ticks are scheduled on a fixed grid, so a slow tick does not make later reports
drift. The publisher's health is never the engine's: an engine whose reports cannot be
written keeps serving, and `report_age_s` says how old its last written report is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

from controlplane import telemetry
from controlplane.clock import Clock
from controlplane.models import EngineCounters, ReplicaReport
from controlplane.redis_conn import Backoff
from controlplane.store import RedisStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """`ttl_periods`: the report hash expires after this many periods without a write, so
    a dead replica vanishes from Redis on its own (ARCHITECTURE: TTL ~3 periods).
    `prefix_keys_period_s`: changed prefix keys are written at most this often (routers
    read them once a second, `RouterConfig.report_refresh_s`; 1,024 keys are ~17 kB)."""

    replica_id: str
    engine_id: str = ""
    model_id: str = ""
    metrics_address: str = ""  # host:port of the replica's Prometheus endpoint, if any
    period_s: float = 0.1
    ttl_periods: float = 3.0
    backoff_cap_s: float = 2.0
    prefix_keys_period_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must be non-empty")
        if self.period_s <= 0 or self.ttl_periods < 1:
            raise ValueError("need period_s > 0 and ttl_periods >= 1")


@dataclass(frozen=True, slots=True)
class PublishStats:
    """Counts since start; `last_published_s`: the clock time of the last written report
    (None before the first)."""

    published: int
    failed: int
    last_error: str | None
    last_published_s: float | None = None


class ReportPublisher:
    def __init__(
        self,
        store: RedisStore,
        read_counters: Callable[[], EngineCounters],
        clock: Clock,
        config: PublisherConfig,
        tracer: trace.Tracer = telemetry.NOOP_TRACER,
    ) -> None:
        self.config = config
        self._store = store
        self._read_counters = read_counters
        self._clock = clock
        self._tracer = tracer
        self._published = 0
        self._failed = 0
        self._last_error: str | None = None
        self._last_published_s: float | None = None

    @property
    def stats(self) -> PublishStats:
        return PublishStats(self._published, self._failed, self._last_error, self._last_published_s)

    def report_age_s(self) -> float | None:
        """Seconds since the last report reached Redis; None when none has yet."""
        if self._last_published_s is None:
            return None
        return max(0.0, self._clock.now() - self._last_published_s)

    def build_report(self) -> ReplicaReport:
        """The report for now; raises `ValueError` if the counters are inconsistent."""
        counters = self._read_counters()
        return ReplicaReport(
            **counters.model_dump(exclude={"tenants"}),
            tenants=counters.tenants,
            replica_id=self.config.replica_id,
            engine_id=self.config.engine_id,
            model_id=self.config.model_id,
            metrics_address=self.config.metrics_address,
            heartbeat_s=self._clock.now(),
        )

    async def publish_once(self) -> bool:
        """Build and write one report; False (and counted) if anything failed.

        Traced as one root span per report (`SPAN_REPORT_PUBLISH`, never inside a request's
        trace) with the report's headline counts; a failed write sets the span's status to
        ERROR with the error's type (`ATTR_ERROR_KIND`)."""
        with self._tracer.start_as_current_span(
            telemetry.SPAN_REPORT_PUBLISH, context=trace.set_span_in_context(trace.INVALID_SPAN)
        ) as span:
            span.set_attribute(telemetry.ATTR_REPLICA_ID, self.config.replica_id)
            try:
                report = self.build_report()
                span.set_attributes(
                    {
                        telemetry.ATTR_REPORT_FREE_BLOCKS: report.free_blocks,
                        telemetry.ATTR_REPORT_RECLAIMABLE_BLOCKS: report.reclaimable_blocks,
                        telemetry.ATTR_REPORT_NUM_TENANTS: len(report.tenants),
                    }
                )
                await asyncio.wait_for(
                    self._store.publish_report(
                        report,
                        ttl_s=self.config.period_s * self.config.ttl_periods,
                        prefix_keys_period_s=self.config.prefix_keys_period_s,
                    ),
                    timeout=self.config.period_s,
                )
            # A report that cannot be built or written is dropped (the next period's
            # replaces it): Redis away, a timeout, inconsistent counters, or any error of
            # the engine's counters callable; none of them may end the publisher's loop.
            except Exception as error:  # noqa: BLE001
                self._failed += 1
                self._last_error = f"{type(error).__name__}: {error}"
                span.set_attribute(telemetry.ATTR_ERROR_KIND, type(error).__name__)
                span.set_status(trace.StatusCode.ERROR, type(error).__name__)
                return False
        self._published += 1
        self._last_published_s = self._clock.now()
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Publish every `period_s` until `stop` is set; never raises (a failed report is
        counted, logged when failures start, and retried with backoff)."""
        backoff = Backoff(
            self.config.period_s, max(self.config.period_s, self.config.backoff_cap_s)
        )
        next_tick = self._clock.now()
        while not stop.is_set():
            if await self.publish_once():
                if backoff.failures:
                    logger.info(
                        "report publisher: writing again after %d failures", backoff.failures
                    )
                backoff.reset()
                next_tick += self.config.period_s
                delay = next_tick - self._clock.now()
                if delay < 0:  # fell behind: skip missed ticks rather than burst
                    next_tick = self._clock.now()
                    delay = 0.0
            else:
                if backoff.failures == 0:
                    logger.warning("report publisher: %s", self._last_error)
                delay = backoff.next_delay_s()
                next_tick = self._clock.now() + delay
            await self._clock.sleep(delay)

    def start(self, stop: asyncio.Event) -> asyncio.Task[None]:
        """Run in the current event loop as a background task (the engine's loop)."""
        return asyncio.get_running_loop().create_task(
            self.run(stop), name=f"vtoken-report-publisher-{self.config.replica_id}"
        )
