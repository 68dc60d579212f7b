"""OpenTelemetry metrics: KV per replica and per tenant, admissions, latency, the controller.

Library code takes a ``Meter`` (``opentelemetry-api``); :func:`configure_metrics` installs
the SDK with an OTLP/HTTP exporter at process start when the standard ``OTEL_*`` variables
ask for one, like :func:`controlplane.tracing.configure_tracing` (without it every
instrument is a no-op). Gauges are observable: the SDK calls back at each export (every
``OTEL_METRIC_EXPORT_INTERVAL`` ms, 60 s unless set) and the callbacks read what the
process already keeps (the replica's last engine counters, the controller's last plan);
they never block and never touch Redis. Names and attributes live in
:mod:`controlplane.telemetry`; :data:`PROMETHEUS_NAMES` gives the names Prometheus sees
(what ``deploy/grafana`` queries).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from controlplane import telemetry
from controlplane.clock import Clock
from controlplane.models import EngineCounters, RoutingPlan, TenantQuota
from controlplane.tracing import OTLP_ENDPOINT_VARIABLES

_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
BLOCK = "{block}"
TOKEN = "{token}"
REQUEST = "{request}"
SECONDS = "s"
BYTES = "By"
# Request latencies from 5 ms to 2 min (TTFT under load, TPOT of small models).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


def metrics_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process should export metrics (OTLP): an endpoint is set, or
    ``OTEL_METRICS_EXPORTER=otlp``; never with ``OTEL_SDK_DISABLED=true`` or another exporter."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = environ.get("OTEL_METRICS_EXPORTER", "")
    if exporter and exporter != "otlp":
        return False
    names = (*OTLP_ENDPOINT_VARIABLES[:1], _METRICS_ENDPOINT)
    return exporter == "otlp" or any(environ.get(name) for name in names)


def configure_metrics(
    service_name: str, environ: Mapping[str, str] = os.environ, prometheus: bool = False
) -> bool:
    """Install a ``MeterProvider`` exporting OTLP/HTTP when the environment asks for one,
    and with ``prometheus`` also read by prometheus-client's default registry (what
    :class:`controlplane.metrics_endpoint.MetricsEndpoint` serves; the SDK's
    ``PrometheusMetricReader``).

    Returns whether a provider is installed. Safe to call more than once per process (the
    first call decides). ``OTEL_SDK_DISABLED=true`` turns both off."""
    otlp = metrics_requested(environ)
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not (otlp or prometheus):
        return False
    if type(metrics.get_meter_provider()).__name__ == "MeterProvider":
        return True  # an SDK provider is already installed in this process
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    readers: list[MetricReader] = []
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if prometheus:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers.append(PrometheusMetricReader())
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", service_name)})
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    return True


class ReplicaMetrics:
    """One replica's KV gauges and counters, read from its latest engine counters.

    ``read_counters`` returns the counters the replica last read from its engine (``None``
    before the first read: nothing is observed). The cumulative counts (preemptions,
    evictions under pressure, blocks reclaimed) are the engine's since it started, exported
    as monotonic counters; a restarted engine starts a new series (new replica id)."""

    def __init__(
        self, meter: Meter, replica_id: str, read_counters: Callable[[], EngineCounters | None]
    ) -> None:
        self._replica = {telemetry.ATTR_REPLICA_ID: replica_id}
        self._read = read_counters
        gauge, counter = meter.create_observable_gauge, meter.create_observable_counter
        gauge(telemetry.METRIC_REPLICA_KV_BLOCKS, [self._blocks], BLOCK, "KV blocks by state.")
        gauge(telemetry.METRIC_REPLICA_LIVE_TOKENS, [self._scalar("live_tokens")], TOKEN)
        running = self._scalar("running_requests")
        gauge(telemetry.METRIC_REPLICA_RUNNING_REQUESTS, [running], REQUEST)
        gauge(telemetry.METRIC_REPLICA_TENANT_KV_BLOCKS, [self._tenants], BLOCK)
        pressure = telemetry.METRIC_REPLICA_EVICTIONS_UNDER_PRESSURE
        for name, field, unit in (
            (telemetry.METRIC_REPLICA_BLOCKS_RECLAIMED, "blocks_reclaimed", BLOCK),
            (telemetry.METRIC_REPLICA_PREEMPTIONS, "preemptions", REQUEST),
            (pressure, "evictions_under_pressure", REQUEST),
            (telemetry.METRIC_REPLICA_EVICTIONS_BELOW_BUDGET, "evictions_below_budget", REQUEST),
            (telemetry.METRIC_REPLICA_EVICTED_TOKENS, "evicted_tokens", TOKEN),
            (telemetry.METRIC_REPLICA_REPACK_MOVES, "repack_moves", TOKEN),
            (telemetry.METRIC_REPLICA_REPACK_BYTES, "repack_bytes", BYTES),
            (telemetry.METRIC_REPLICA_REPACK_DURATION, "repack_seconds", SECONDS),
        ):
            counter(name, [self._scalar(field)], unit)
        step = self._scalar("max_step_s")
        gauge(telemetry.METRIC_REPLICA_STEP_DURATION, [step], SECONDS, "Longest recent step.")

    def _blocks(self, _: CallbackOptions) -> Iterable[Observation]:
        counters = self._read()
        if counters is None:
            return []
        floor = sum(usage.floor_blocks for usage in counters.tenants.values())
        held = sum(usage.blocks for usage in counters.tenants.values())
        values = {
            "total": counters.total_blocks,
            "free": counters.free_blocks,
            "held": held,
            "floor": floor,
            "reclaimable": counters.reclaimable_blocks,
        }
        state = telemetry.ATTR_BLOCK_STATE
        return [Observation(values[s], {**self._replica, state: s}) for s in telemetry.BLOCK_STATES]

    def _scalar(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            counters = self._read()
            if counters is None:
                return []
            return [Observation(getattr(counters, field), self._replica)]

        return observe

    def _tenants(self, _: CallbackOptions) -> Iterable[Observation]:
        counters = self._read()
        if counters is None:
            return []
        return [
            Observation(usage.blocks, {**self._replica, telemetry.ATTR_TENANT_ID: tenant})
            for tenant, usage in counters.tenants.items()
        ]


class ControllerMetrics:
    """The controller's view: each tenant's measured active KV against its budget, the age
    of the current plan, and the duration of leader cycles (:meth:`record_cycle`).

    ``read_plan`` and ``read_quotas`` return what the controller last wrote or read (kept
    while Redis is away, so a growing plan age is what shows the outage). A tenant without
    a quota has no budget series; a tenant the plan does not route has no active series."""

    def __init__(
        self,
        meter: Meter,
        clock: Clock,
        read_plan: Callable[[], RoutingPlan | None],
        read_quotas: Callable[[], Mapping[str, TenantQuota]],
    ) -> None:
        self._clock = clock
        self._read_plan = read_plan
        self._read_quotas = read_quotas
        gauge = meter.create_observable_gauge
        gauge(telemetry.METRIC_TENANT_KV_ACTIVE, [self._active], BLOCK)
        gauge(telemetry.METRIC_TENANT_KV_BUDGET, [self._budget], BLOCK)
        gauge(telemetry.METRIC_PLAN_AGE, [self._plan_age], SECONDS)
        self._cycle = meter.create_histogram(telemetry.METRIC_CONTROLLER_CYCLE_DURATION, SECONDS)

    def record_cycle(self, duration_s: float) -> None:
        self._cycle.record(duration_s)

    def _active(self, _: CallbackOptions) -> Iterable[Observation]:
        plan = self._read_plan()
        if plan is None:
            return []
        return [
            Observation(route.usage_blocks, {telemetry.ATTR_TENANT_ID: tenant})
            for tenant, route in plan.tenants.items()
        ]

    def _budget(self, _: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(quota.kv_budget_blocks, {telemetry.ATTR_TENANT_ID: tenant})
            for tenant, quota in self._read_quotas().items()
        ]

    def _plan_age(self, _: CallbackOptions) -> Iterable[Observation]:
        plan = self._read_plan()
        if plan is None:
            return []
        return [Observation(max(0.0, self._clock.now() - plan.created_s))]


class RequestMetrics:
    """The ingress's per-tenant admissions and latencies (TTFT, TPOT)."""

    def __init__(self, meter: Meter) -> None:
        self._meter = meter
        self._admissions = meter.create_counter(telemetry.METRIC_ADMISSIONS, REQUEST)
        buckets = list(LATENCY_BUCKETS_S)
        self._queue_wait = meter.create_histogram(
            telemetry.METRIC_QUEUE_WAIT, SECONDS, explicit_bucket_boundaries_advisory=buckets
        )
        self._ttft = meter.create_histogram(
            telemetry.METRIC_TIME_TO_FIRST_TOKEN,
            SECONDS,
            explicit_bucket_boundaries_advisory=buckets,
        )
        self._tpot = meter.create_histogram(
            telemetry.METRIC_TIME_PER_OUTPUT_TOKEN,
            SECONDS,
            explicit_bucket_boundaries_advisory=buckets,
        )

    def queue_wait(self, tenant_id: str, seconds: float) -> None:
        """A queued request's wait, however it ended."""
        self._queue_wait.record(seconds, {telemetry.ATTR_TENANT_ID: tenant_id})

    def observe_queues(self, waiting: Callable[[], Iterable[tuple[str, int, float]]]) -> None:
        """Gauges of the requests this ingress holds queued: ``waiting()`` yields
        ``(tenant, depth, oldest wait in s)`` (it must not block)."""

        def depth(_: CallbackOptions) -> Iterable[Observation]:
            for tenant_id, num, _oldest in waiting():
                yield Observation(num, {telemetry.ATTR_TENANT_ID: tenant_id})

        def oldest(_: CallbackOptions) -> Iterable[Observation]:
            for tenant_id, _num, oldest_s in waiting():
                yield Observation(oldest_s, {telemetry.ATTR_TENANT_ID: tenant_id})

        self._meter.create_observable_gauge(telemetry.METRIC_QUEUE_DEPTH, [depth], REQUEST)
        self._meter.create_observable_gauge(telemetry.METRIC_QUEUE_OLDEST_WAIT, [oldest], SECONDS)

    def admission(self, tenant_id: str, outcome: str) -> None:
        outcome_attribute = telemetry.ATTR_ADMISSION_OUTCOME
        self._admissions.add(1, {telemetry.ATTR_TENANT_ID: tenant_id, outcome_attribute: outcome})

    def first_token(self, tenant_id: str, seconds: float) -> None:
        """A request's first token, ``seconds`` after its arrival (recorded when it comes,
        so answers abandoned or failed later still count)."""
        self._ttft.record(seconds, {telemetry.ATTR_TENANT_ID: tenant_id})

    def request_done(
        self, tenant_id: str, first_token_s: float, last_token_s: float, output_tokens: int
    ) -> None:
        """One finished request's time per output token: seconds from arrival to its first
        and last token over its tokens (per sequence: for ``n`` > 1 the mean length)."""
        attributes = {telemetry.ATTR_TENANT_ID: tenant_id}
        if output_tokens > 1:
            tpot = (last_token_s - first_token_s) / (output_tokens - 1)
            self._tpot.record(tpot, attributes)


def _prometheus(name: str, unit: str, kind: str) -> tuple[str, ...]:
    base = name.replace(".", "_") + {SECONDS: "_seconds", BYTES: "_bytes"}.get(unit, "")
    if kind == "counter":
        return (f"{base}_total",)
    if kind == "histogram":
        return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
    return (base,)


PROMETHEUS_NAMES: frozenset[str] = frozenset(
    prometheus
    for name, unit, kind in (
        (telemetry.METRIC_REPLICA_KV_BLOCKS, BLOCK, "gauge"),
        (telemetry.METRIC_QUEUE_WAIT, SECONDS, "histogram"),
        (telemetry.METRIC_QUEUE_DEPTH, REQUEST, "gauge"),
        (telemetry.METRIC_QUEUE_OLDEST_WAIT, SECONDS, "gauge"),
        (telemetry.METRIC_REPLICA_LIVE_TOKENS, TOKEN, "gauge"),
        (telemetry.METRIC_REPLICA_RUNNING_REQUESTS, REQUEST, "gauge"),
        (telemetry.METRIC_REPLICA_TENANT_KV_BLOCKS, BLOCK, "gauge"),
        (telemetry.METRIC_REPLICA_BLOCKS_RECLAIMED, BLOCK, "counter"),
        (telemetry.METRIC_REPLICA_PREEMPTIONS, REQUEST, "counter"),
        (telemetry.METRIC_REPLICA_EVICTIONS_UNDER_PRESSURE, REQUEST, "counter"),
        (telemetry.METRIC_REPLICA_EVICTIONS_BELOW_BUDGET, REQUEST, "counter"),
        (telemetry.METRIC_REPLICA_EVICTED_TOKENS, TOKEN, "counter"),
        (telemetry.METRIC_REPLICA_REPACK_MOVES, TOKEN, "counter"),
        (telemetry.METRIC_REPLICA_REPACK_BYTES, BYTES, "counter"),
        (telemetry.METRIC_REPLICA_REPACK_DURATION, SECONDS, "counter"),
        (telemetry.METRIC_REPLICA_STEP_DURATION, SECONDS, "gauge"),
        (telemetry.METRIC_TENANT_KV_ACTIVE, BLOCK, "gauge"),
        (telemetry.METRIC_TENANT_KV_BUDGET, BLOCK, "gauge"),
        (telemetry.METRIC_PLAN_AGE, SECONDS, "gauge"),
        (telemetry.METRIC_CONTROLLER_CYCLE_DURATION, SECONDS, "histogram"),
        (telemetry.METRIC_ADMISSIONS, REQUEST, "counter"),
        (telemetry.METRIC_TIME_TO_FIRST_TOKEN, SECONDS, "histogram"),
        (telemetry.METRIC_TIME_PER_OUTPUT_TOKEN, SECONDS, "histogram"),
    )
    for prometheus in _prometheus(name, unit, kind)
)
"""Every series name the instruments above get in Prometheus (OpenTelemetry's Prometheus
naming: dots become underscores, unit ``s`` adds ``_seconds`` and ``By`` ``_bytes``,
``{...}`` adds nothing, counters end in ``_total``, histograms are
``_bucket``/``_sum``/``_count``). The test checks it against the SDK's own Prometheus
exporter."""
