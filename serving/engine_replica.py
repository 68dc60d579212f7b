"""The Ray Serve deployment of an engine replica: its :class:`EngineHost`, the reporter that
talks to the control plane (when the replica has Redis) and its Prometheus endpoint."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from opentelemetry import metrics, trace
from ray import serve

from controlplane import telemetry
from controlplane.clock import SystemClock
from controlplane.keys import KeySpace
from controlplane.metrics_endpoint import MetricsEndpoint
from controlplane.openai_models import GenerateRequest
from controlplane.otel_metrics import ReplicaMetrics, configure_metrics
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from controlplane.tracing import configure_tracing
from serving.engine_host import EngineHost
from serving.replica_reporter import ReplicaReporter
from serving.settings import ReplicaSettings

logger = logging.getLogger(__name__)


@serve.deployment(name="engine", health_check_period_s=5, health_check_timeout_s=30)
class EngineReplica:
    def __init__(self, settings: ReplicaSettings, metrics_token: str | None = None) -> None:
        """``metrics_token``: the admin token, which the replica's Prometheus endpoint asks
        for (``None``: the endpoint is not served)."""
        configure_tracing("vtoken-replica")
        replica_id = serve.get_replica_context().replica_id.unique_id
        # Bound before the engine loads, so a taken port fails in seconds, not minutes.
        self._metrics_endpoint = self._serve_metrics(settings, metrics_token)
        tracer = trace.get_tracer(telemetry.TRACER_REPLICA)
        try:
            self.host = EngineHost(settings, replica_id, SystemClock(), tracer)
        except BaseException:
            if self._metrics_endpoint is not None:
                self._metrics_endpoint.close()
            raise
        metrics_address = ""
        if self._metrics_endpoint is not None:
            metrics_address = self._metrics_endpoint.address
            logger.info("replica %s: Prometheus metrics on %s", replica_id, metrics_address)
        meter = metrics.get_meter(telemetry.TRACER_REPLICA)
        host = self.host
        self.metrics = ReplicaMetrics(
            meter, replica_id, lambda: host.counters if host.counters_at is not None else None
        )
        self.reporter: ReplicaReporter | None = None
        self._task: asyncio.Task | None = None
        if settings.redis_url:
            redis = connect(RedisConfig(url=settings.redis_url))
            store = RedisStore(redis, KeySpace(settings.key_prefix))
            self.reporter = ReplicaReporter(
                self.host, store, self.host.clock, tracer, metrics_address
            )
            self._task = asyncio.get_event_loop().create_task(self.reporter.run())

    @staticmethod
    def _serve_metrics(settings: ReplicaSettings, token: str | None) -> MetricsEndpoint | None:
        """The replica's Prometheus endpoint on its node's address (what Prometheus on
        another node reaches), or ``None``: not asked for, no admin token to guard it, or
        OpenTelemetry disabled (``OTEL_SDK_DISABLED``: nothing to serve)."""
        serves = settings.metrics_port is not None
        if not configure_metrics("vtoken-replica", prometheus=serves) or not serves:
            return None
        if token is None:
            logger.warning("replica: no admin token to guard its Prometheus endpoint: not served")
            return None
        node = ray.util.get_node_ip_address()
        return MetricsEndpoint(node, settings.metrics_port or 0, token)

    async def generate(self, request: dict[str, Any]):  # type: ignore[no-untyped-def]
        async for chunk in self.host.generate(GenerateRequest.model_validate(request)):
            yield chunk.model_dump()

    async def counters(self) -> dict[str, Any]:
        return (await self.host.refresh_counters()).model_dump()

    async def check_health(self) -> None:
        """The engine's health only. The report loop never decides it: a loop that stopped
        (it should not: it survives every Redis error) is logged and started again, and its
        report age shows in :meth:`report_status` and goes stale in the controller's view."""
        await self.host.check_health()
        if self.reporter is not None and self._task is not None and self._task.done():
            if not self._task.cancelled() and self._task.exception() is not None:
                logger.error("replica report loop stopped: %r", self._task.exception())
            self._task = asyncio.get_running_loop().create_task(self.reporter.run())

    async def report_status(self) -> dict[str, Any]:
        """The reporter's status (:meth:`ReplicaReporter.status`); empty without Redis."""
        return self.reporter.status() if self.reporter is not None else {}

    def record_routing_stats(self) -> dict[str, Any]:
        counters = self.host.counters
        return {"free_blocks": counters.free_blocks, "reclaimable": counters.reclaimable_blocks}

    async def __del__(self) -> None:
        if self.reporter is not None:
            self.reporter.stop.set()
        if self._metrics_endpoint is not None:
            await asyncio.to_thread(self._metrics_endpoint.close)
        self.host.shutdown()
