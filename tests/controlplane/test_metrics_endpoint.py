"""A process's own Prometheus endpoint: the admin token guards it, a taken port fails at
once, and it serves what the OpenTelemetry Prometheus reader collects."""

from __future__ import annotations

import socket

import httpx
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from controlplane import telemetry
from controlplane.metrics_endpoint import MetricsEndpoint
from controlplane.otel_metrics import ReplicaMetrics
from tests.controlplane.test_otel_metrics import counters

TOKEN = "a-test-admin-token-that-is-long-enough-123"


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(disable_target_info=True, registry=registry)
    meter = MeterProvider(metric_readers=[reader]).get_meter(telemetry.TRACER_REPLICA)
    ReplicaMetrics(meter, "r1", counters)
    served = MetricsEndpoint("127.0.0.1", 0, TOKEN, registry)
    yield served
    served.close()


def test_metrics_need_the_admin_token(endpoint: MetricsEndpoint) -> None:
    url = f"http://{endpoint.address}/metrics"
    assert endpoint.address == f"127.0.0.1:{endpoint.port}" and endpoint.port > 0
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 401 and "vtoken_" not in wrong.text
    answer = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    samples = {
        (sample.name, sample.labels.get("vtoken_block_state")): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }
    assert samples[("vtoken_replica_kv_blocks", "total")] == 100
    assert samples[("vtoken_replica_kv_repack_bytes_total", None)] == counters().repack_bytes


def test_a_taken_port_fails_when_binding(endpoint: MetricsEndpoint) -> None:
    with pytest.raises(OSError):
        MetricsEndpoint("127.0.0.1", endpoint.port, TOKEN, CollectorRegistry())


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_an_ipv6_address_is_bracketed() -> None:
    try:
        served = MetricsEndpoint("::1", 0, TOKEN, CollectorRegistry())
    except OSError:
        pytest.skip("IPv6 loopback unavailable")
    try:
        assert served.address == f"[::1]:{served.port}"
        answer = httpx.get(
            f"http://{served.address}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert answer.status_code == 200
    finally:
        served.close()
