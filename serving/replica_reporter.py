"""A replica's conversation with the control plane through Redis: its counters out (read
from the engine, published as reports), the controller's plan in (pressure and
allowances applied to the engine), and where its Prometheus endpoint is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from opentelemetry import trace

from controlplane import telemetry
from controlplane.clock import Clock
from controlplane.plan_follower import PlanFollower
from controlplane.publisher import PublisherConfig, ReportPublisher
from controlplane.store import RedisStore
from serving.engine_host import EngineHost

logger = logging.getLogger(__name__)
PLAN_POLL_S = 0.1  # one read of the replica's plan slice: pressure lands within a report
# period of its plan (1,000 replicas: 10,000 small script calls/s)
PLAN_MAX_AGE_S = 30.0  # an older plan's pressure is dropped: no controller is measuring
COUNTERS_TIMEOUT_S = 2.0
METRICS_ADVERTISE_S = 10.0  # how often a replica rewrites where its /metrics is


class ReplicaReporter:
    """Polls the engine's counters and publishes them, both every ``report_period_s``;
    follows the controller's plan every :data:`PLAN_POLL_S`; advertises ``metrics_address``
    (when there is one) every :data:`METRICS_ADVERTISE_S`. Each loop survives every error
    (logged) and ends when ``stop`` is set."""

    def __init__(
        self,
        host: EngineHost,
        store: RedisStore,
        clock: Clock,
        tracer: trace.Tracer = telemetry.NOOP_TRACER,
        metrics_address: str = "",
    ) -> None:
        self.host = host
        self.store = store
        self.clock = clock
        config = PublisherConfig(
            replica_id=host.replica_id,
            model_id=host.settings.name,
            metrics_address=metrics_address,
            period_s=host.settings.report_period_s,
        )
        self.publisher = ReportPublisher(store, host.fresh_counters, clock, config, tracer)
        self.plan = PlanFollower(store, host.replica_id, clock, PLAN_MAX_AGE_S)
        self.metrics_address = metrics_address
        self.stop = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(
            self._poll_counters(),
            self._follow_plan(),
            self._advertise_metrics(),
            self.publisher.run(self.stop),
        )

    async def _poll_counters(self) -> None:
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self.host.refresh_counters(), timeout=COUNTERS_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a failed poll keeps the last counters
                logger.exception("replica %s: reading counters failed", self.host.replica_id)
            await self.clock.sleep(self.host.settings.report_period_s)

    async def _follow_plan(self) -> None:
        while not self.stop.is_set():
            # One read of this replica's slice of the plan (a few hundred bytes) per poll.
            try:
                pressure = await self.plan.poll()
                await self.host.apply_pressure(pressure, self.plan.allowance_now())
            except Exception:  # noqa: BLE001 - a dead engine fails its own health check
                logger.exception("replica %s: applying pressure failed", self.host.replica_id)
            await self.clock.sleep(PLAN_POLL_S)

    async def _advertise_metrics(self) -> None:
        """Where Prometheus finds this replica (``/admin/metrics/targets``); rewritten now
        and then, so a Redis that lost it (restart, flush) learns it again."""
        while self.metrics_address and not self.stop.is_set():
            try:
                await self.store.advertise_metrics(
                    self.host.replica_id, self.metrics_address, self.host.settings.name
                )
            except Exception as error:  # noqa: BLE001 - retried at the next period
                logger.warning("replica: advertising metrics failed: %r", error)
            with contextlib.suppress(TimeoutError):  # stops at once when asked to
                await asyncio.wait_for(self.stop.wait(), METRICS_ADVERTISE_S)

    def status(self) -> dict[str, Any]:
        """What the reporter did: reports written and failed, the last error, and the age of
        the last report that reached Redis (None before the first): visible here and in
        the controller's view of the replica, never a reason to restart the engine."""
        stats = self.publisher.stats
        return {
            "report_age_s": self.publisher.report_age_s(),
            "published": stats.published,
            "failed": stats.failed,
            "last_error": stats.last_error,
        }
