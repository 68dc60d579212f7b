"""Prometheus metrics of the ingress (exposed at ``GET /metrics``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class IngressMetrics:
    """One registry per ingress process, so repeated construction in tests never clashes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._admissions = Counter(
            # Not OpenTelemetry's `vtoken_admissions` (``RequestMetrics``, with other label
            # names): one scrape of both must not add the two up.
            "vtoken_ingress_admissions",
            "Admission decisions by tenant and outcome.",
            ["tenant", "outcome"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "vtoken_request_seconds",
            "Time from arrival to the last token, by tenant.",
            ["tenant"],
            registry=self.registry,
        )

        self._queue_wait = Histogram(
            "vtoken_ingress_queue_wait_seconds",
            "How long queued requests waited for admission, by tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self._queue_depth = Gauge(
            "vtoken_ingress_queue_depth",
            "Requests this ingress holds queued, by tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self._queue_oldest = Gauge(
            "vtoken_ingress_queue_oldest_wait_seconds",
            "How long the oldest request this ingress holds queued has waited, by tenant.",
            ["tenant"],
            registry=self.registry,
        )

    def queue_wait(self, tenant_id: str, seconds: float) -> None:
        self._queue_wait.labels(tenant=tenant_id).observe(seconds)

    def queues(self, waiting: Iterable[tuple[str, int, float]]) -> None:
        """Set the queue gauges to ``(tenant, depth, oldest wait in s)`` rows; tenants not
        in them have none queued here."""
        self._queue_depth.clear()
        self._queue_oldest.clear()
        for tenant_id, depth, oldest_s in waiting:
            self._queue_depth.labels(tenant=tenant_id).set(depth)
            self._queue_oldest.labels(tenant=tenant_id).set(oldest_s)

    def admission(self, tenant_id: str, outcome: str) -> None:
        self._admissions.labels(tenant=tenant_id, outcome=outcome).inc()

    def latency(self, tenant_id: str, seconds: float) -> None:
        self._latency.labels(tenant=tenant_id).observe(seconds)

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop every series of ``tenant_id`` (a deleted tenant's admissions and latency)."""
        for metric in (self._admissions, self._latency, self._queue_wait):
            metric.remove_by_labels({"tenant": tenant_id})

    def render(self) -> bytes:
        return generate_latest(self.registry)
