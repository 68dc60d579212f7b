"""The controller as a one-replica Ray Serve deployment running the control loop."""

from __future__ import annotations

import asyncio
import uuid

from opentelemetry import metrics, trace
from ray import serve

from controlplane import telemetry
from controlplane.clock import SystemClock
from controlplane.controller import Controller, ControllerConfig
from controlplane.keys import KeySpace
from controlplane.lease import ControllerLease
from controlplane.otel_metrics import ControllerMetrics, configure_metrics
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from controlplane.tracing import configure_tracing


@serve.deployment(name="controller", num_replicas=1, ray_actor_options={"num_cpus": 0.1})
class ControllerDeployment:
    def __init__(self, redis_url: str, key_prefix: str = "vtoken", period_s: float = 0.5) -> None:
        configure_tracing("vtoken-controller")
        configure_metrics("vtoken-controller")
        keys = KeySpace(key_prefix)
        redis = connect(RedisConfig(url=redis_url))
        config = ControllerConfig(period_s=period_s, lease_ttl_s=max(2.0, 4 * period_s))
        lease = ControllerLease(
            redis, f"controller-{uuid.uuid4().hex[:8]}", config.lease_ttl_s, keys
        )
        clock = SystemClock()
        self.metrics = ControllerMetrics(
            metrics.get_meter(telemetry.TRACER_CONTROLLER),
            clock,
            lambda: self.controller.current_plan,
            lambda: self.controller.quotas,
        )
        self.controller = Controller(
            RedisStore(redis, keys),
            lease,
            clock,
            config,
            tracer=trace.get_tracer(telemetry.TRACER_CONTROLLER),
            on_cycle=lambda cycle: self.metrics.record_cycle(
                cycle.read_s + cycle.plan_s + cycle.write_s
            ),
        )
        self._stop = asyncio.Event()
        self._task = asyncio.get_event_loop().create_task(self.controller.run(self._stop))

    async def check_health(self) -> None:
        if self._task.done():
            raise RuntimeError(f"controller loop stopped: {self._task.exception()!r}")

    async def plan_version(self) -> int | None:
        plan = self.controller.current_plan
        return plan.version if plan is not None else None

    async def __del__(self) -> None:
        self._stop.set()
        await self.controller.shutdown()
