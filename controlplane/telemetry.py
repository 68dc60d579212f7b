"""Every span, attribute and metric name the control plane emits, in one place.

Library code uses `opentelemetry-api` only; the SDK and exporter are configured at process
start. Tracers are injected; `NOOP_TRACER` is the default when none is given.
"""

from __future__ import annotations

from opentelemetry import trace

NOOP_TRACER: trace.Tracer = trace.NoOpTracer()

# Span names.
SPAN_CONTROLLER_CYCLE = "vtoken.controller.cycle"
SPAN_PLAN_COMPUTE = "vtoken.controller.plan"
SPAN_PLAN_WRITE = "vtoken.controller.plan_write"
SPAN_ADMISSION = "vtoken.admission"
SPAN_REPORT_PUBLISH = "vtoken.report.publish"

# Span / metric attribute names.
ATTR_TENANT_ID = "vtoken.tenant.id"
ATTR_REPLICA_ID = "vtoken.replica.id"
ATTR_REQUEST_ID = "vtoken.request.id"
ATTR_PLAN_VERSION = "vtoken.plan.version"
ATTR_LEASE_FENCE = "vtoken.lease.fence"
ATTR_NUM_REPLICAS = "vtoken.plan.num_replicas"
ATTR_NUM_TENANTS = "vtoken.plan.num_tenants"
ATTR_NUM_MOVES = "vtoken.plan.num_moves"
ATTR_NUM_DRAINED = "vtoken.plan.num_drained"
ATTR_ADMISSION_OUTCOME = "vtoken.admission.outcome"
ATTR_ADMISSION_REASON = "vtoken.admission.reason"
ATTR_RESERVED_BLOCKS = "vtoken.admission.reserved_blocks"
ATTR_RETRY_AFTER_S = "vtoken.admission.retry_after_s"
ATTR_ROUTE_SOURCE = "vtoken.route.source"
ATTR_ERROR_KIND = "vtoken.error.kind"

# Metric names (instruments are created by the process that owns the meter).
METRIC_ADMISSIONS = "vtoken.admissions"
