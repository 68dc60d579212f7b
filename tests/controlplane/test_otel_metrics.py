"""The OpenTelemetry instruments, read back with the SDK's in-memory reader, and the names
Prometheus sees, read back with the SDK's own Prometheus exporter."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from controlplane import telemetry
from controlplane.models import EngineCounters, RoutingPlan, TenantRoute
from controlplane.otel_metrics import (
    PROMETHEUS_NAMES,
    ControllerMetrics,
    ReplicaMetrics,
    RequestMetrics,
    configure_metrics,
    metrics_requested,
)
from tests.controlplane.builders import quota, report
from tests.controlplane.fakes import FakeClock

Points = dict[str, list[tuple[dict[str, Any], Any]]]


def collect(reader: InMemoryMetricReader) -> Points:
    """metric name -> [(attributes, value or histogram (count, sum))]."""
    points: Points = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    if value is None:
                        value = (getattr(point, "count"), getattr(point, "sum"))  # noqa: B009
                    attributes = dict(point.attributes or {})
                    points.setdefault(metric.name, []).append((attributes, value))
    return points


def counters() -> EngineCounters:
    snapshot = report("r1", 0.0, {"acme": 30, "beta": 10}, floors={"acme": 12}, reclaimable=18)
    return EngineCounters.model_validate(
        {
            **snapshot.model_dump(include=set(EngineCounters.model_fields)),
            "running_requests": 2,
            "preemptions": 3,
            "blocks_reclaimed": 40,
            "evictions_under_pressure": 5,
            "evictions_below_budget": 4,
            "evicted_tokens": 900,
            "repack_moves": 410,
            "repack_bytes": 410 * 2304,
            "repack_seconds": 0.125,
            "max_step_s": 0.25,
        }
    )


def plan(created_s: float) -> RoutingPlan:
    route = {"replicas": [{"replica_id": "r1", "weight": 1.0}]}
    return RoutingPlan(
        version=7,
        fence=1,
        created_s=created_s,
        replica_ids=("r1",),
        tenants={"acme": TenantRoute.model_validate({**route, "usage_blocks": 30})},
    )


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


def test_replica_kv_per_state_and_per_tenant(reader: InMemoryMetricReader):
    latest: list[EngineCounters] = []
    meter = MeterProvider(metric_readers=[reader]).get_meter(telemetry.TRACER_REPLICA)
    ReplicaMetrics(meter, "r1", lambda: latest[-1] if latest else None)
    assert collect(reader) == {}  # nothing observed before the first engine read

    latest.append(counters())
    points = collect(reader)
    replica = {telemetry.ATTR_REPLICA_ID: "r1"}
    blocks = {
        attributes[telemetry.ATTR_BLOCK_STATE]: value
        for attributes, value in points[telemetry.METRIC_REPLICA_KV_BLOCKS]
    }
    assert blocks == {"total": 100, "free": 60, "held": 40, "floor": 22, "reclaimable": 18}
    assert points[telemetry.METRIC_REPLICA_TENANT_KV_BLOCKS] == [
        ({**replica, telemetry.ATTR_TENANT_ID: "acme"}, 30),
        ({**replica, telemetry.ATTR_TENANT_ID: "beta"}, 10),
    ]
    assert points[telemetry.METRIC_REPLICA_LIVE_TOKENS] == [(replica, 640)]
    assert points[telemetry.METRIC_REPLICA_RUNNING_REQUESTS] == [(replica, 2)]
    assert points[telemetry.METRIC_REPLICA_PREEMPTIONS] == [(replica, 3)]
    assert points[telemetry.METRIC_REPLICA_BLOCKS_RECLAIMED] == [(replica, 40)]
    assert points[telemetry.METRIC_REPLICA_EVICTIONS_UNDER_PRESSURE] == [(replica, 5)]
    assert points[telemetry.METRIC_REPLICA_EVICTIONS_BELOW_BUDGET] == [(replica, 4)]
    assert points[telemetry.METRIC_REPLICA_EVICTED_TOKENS] == [(replica, 900)]
    assert points[telemetry.METRIC_REPLICA_REPACK_MOVES] == [(replica, 410)]
    assert points[telemetry.METRIC_REPLICA_REPACK_BYTES] == [(replica, 410 * 2304)]
    assert points[telemetry.METRIC_REPLICA_REPACK_DURATION] == [(replica, 0.125)]
    assert points[telemetry.METRIC_REPLICA_STEP_DURATION] == [(replica, 0.25)]


def test_controller_active_kv_against_budget_and_plan_age(reader: InMemoryMetricReader):
    clock = FakeClock()
    current: list[RoutingPlan] = []
    meter = MeterProvider(metric_readers=[reader]).get_meter(telemetry.TRACER_CONTROLLER)
    metrics = ControllerMetrics(
        meter,
        clock,
        lambda: current[-1] if current else None,
        lambda: {"acme": quota("acme", 25), "idle": quota("idle", 8)},
    )
    points = collect(reader)
    assert telemetry.METRIC_TENANT_KV_ACTIVE not in points  # no plan yet
    assert telemetry.METRIC_PLAN_AGE not in points

    current.append(plan(created_s=clock.now()))
    clock.advance(4.5)
    metrics.record_cycle(0.02)
    metrics.record_cycle(0.04)
    points = collect(reader)
    tenant = telemetry.ATTR_TENANT_ID
    assert points[telemetry.METRIC_TENANT_KV_ACTIVE] == [({tenant: "acme"}, 30)]
    assert points[telemetry.METRIC_TENANT_KV_BUDGET] == [
        ({tenant: "acme"}, 25),
        ({tenant: "idle"}, 8),
    ]
    assert points[telemetry.METRIC_PLAN_AGE] == [({}, 4.5)]
    [(_, (count, total))] = points[telemetry.METRIC_CONTROLLER_CYCLE_DURATION]
    assert count == 2 and total == pytest.approx(0.06)


def test_admissions_and_latency_per_tenant(reader: InMemoryMetricReader):
    metrics = RequestMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"))
    metrics.admission("acme", "admitted")
    metrics.admission("acme", "throttled")
    metrics.admission("acme", "throttled")
    metrics.first_token("acme", 0.2)
    metrics.request_done("acme", first_token_s=0.2, last_token_s=1.2, output_tokens=11)
    metrics.first_token("acme", 0.4)
    metrics.request_done("acme", first_token_s=0.4, last_token_s=0.4, output_tokens=1)
    metrics.first_token("acme", 0.3)  # an answer abandoned after its first token
    points = collect(reader)
    outcomes = {
        attributes[telemetry.ATTR_ADMISSION_OUTCOME]: value
        for attributes, value in points[telemetry.METRIC_ADMISSIONS]
    }
    assert outcomes == {"admitted": 1, "throttled": 2}
    [(_, (count, total))] = points[telemetry.METRIC_TIME_TO_FIRST_TOKEN]
    assert count == 3 and total == pytest.approx(0.9)
    [(_, (count, total))] = points[telemetry.METRIC_TIME_PER_OUTPUT_TOKEN]
    assert count == 1 and total == pytest.approx(0.1)  # one token has no gap


def test_prometheus_names_are_the_exporters():
    """PROMETHEUS_NAMES (what the dashboard may query) is exactly what the SDK's Prometheus
    exporter renders for every instrument, once each has a value."""
    exporter = pytest.importorskip("opentelemetry.exporter.prometheus")
    registry = CollectorRegistry()
    reader = exporter.PrometheusMetricReader(disable_target_info=True, registry=registry)
    meter = MeterProvider(metric_readers=[reader]).get_meter("vtoken")
    ReplicaMetrics(meter, "r1", counters)
    clock = FakeClock()
    controller = ControllerMetrics(
        meter, clock, lambda: plan(clock.now()), lambda: {"acme": quota("acme")}
    )
    controller.record_cycle(0.01)
    requests = RequestMetrics(meter)
    requests.admission("acme", "admitted")
    requests.first_token("acme", 0.1)
    requests.request_done("acme", 0.1, 0.3, 3)
    requests.queue_wait("acme", 0.2)
    requests.observe_queues(lambda: [("acme", 2, 1.5)])

    rendered = generate_latest(registry).decode()
    names = {
        line.split("{")[0].split(" ")[0]
        for line in rendered.splitlines()
        if line and not line.startswith("#")
    }
    names -= {"otel_scope_info"}
    assert names == PROMETHEUS_NAMES


def test_metrics_follow_the_standard_variables():
    assert not metrics_requested({})
    assert metrics_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert metrics_requested({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"})
    assert metrics_requested({"OTEL_METRICS_EXPORTER": "otlp"})
    assert not metrics_requested(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_METRICS_EXPORTER": "none"}
    )
    assert not metrics_requested(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}
    )
    # Only the traces endpoint set: traces go there, metrics have nowhere to go.
    assert not metrics_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not configure_metrics("vtoken-test", {})


async def test_report_publisher_spans_are_root_spans_with_the_report(store, clock):
    """The publisher's spans (SPAN_REPORT_PUBLISH): one root span per report with its
    headline counts; a failed write is an ERROR span naming the error's type."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from controlplane.publisher import PublisherConfig, ReportPublisher

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(telemetry.TRACER_REPLICA)
    good = ReportPublisher(store, counters, clock, PublisherConfig("r1", period_s=1.0), tracer)
    with tracer.start_as_current_span("unrelated request"):
        assert await good.publish_once()
    bad_counters = ReportPublisher(
        store, lambda: EngineCounters.model_validate({}), clock, PublisherConfig("r1"), tracer
    )
    assert not await bad_counters.publish_once()

    published, failed = (s for s in exporter.get_finished_spans() if s.name != "unrelated request")
    assert published.name == telemetry.SPAN_REPORT_PUBLISH
    assert published.parent is None  # never inside a request's trace
    assert published.attributes is not None
    assert published.attributes[telemetry.ATTR_REPLICA_ID] == "r1"
    assert published.attributes[telemetry.ATTR_REPORT_FREE_BLOCKS] == 60
    assert published.attributes[telemetry.ATTR_REPORT_RECLAIMABLE_BLOCKS] == 18
    assert published.attributes[telemetry.ATTR_REPORT_NUM_TENANTS] == 2
    assert published.status.status_code is StatusCode.UNSET
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None
    assert failed.attributes[telemetry.ATTR_ERROR_KIND] == "ValidationError"


def test_engine_traces_go_where_ours_go_over_http():
    from controlplane.tracing import ENGINE_TRACES_PROTOCOL, engine_traces_endpoint

    assert engine_traces_endpoint({}) is None
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert engine_traces_endpoint(base) == "http://collector:4318/v1/traces"
    traces = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4318/v1/traces"}
    assert engine_traces_endpoint(traces) == "http://tempo:4318/v1/traces"
    assert engine_traces_endpoint({**base, "OTEL_SDK_DISABLED": "true"}) is None
    assert ENGINE_TRACES_PROTOCOL == ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
