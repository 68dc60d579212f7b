"""Prometheus metrics of the ingress (exposed at ``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


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

    def admission(self, tenant_id: str, outcome: str) -> None:
        self._admissions.labels(tenant=tenant_id, outcome=outcome).inc()

    def latency(self, tenant_id: str, seconds: float) -> None:
        self._latency.labels(tenant=tenant_id).observe(seconds)

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop every series of ``tenant_id`` (a deleted tenant's admissions and latency)."""
        for metric in (self._admissions, self._latency):
            metric.remove_by_labels({"tenant": tenant_id})

    def render(self) -> bytes:
        return generate_latest(self.registry)
