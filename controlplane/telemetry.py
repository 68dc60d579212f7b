"""Every tracer, span, event, attribute and metric name vtoken emits, in one place.

Library code uses `opentelemetry-api` only; the SDK and exporter are configured at process
start. Tracers are injected: each process builds its own from a `TRACER_*` name where it
constructs the class that traces; `NOOP_TRACER` is the default when none is given.
"""

from __future__ import annotations

from opentelemetry import trace

NOOP_TRACER: trace.Tracer = trace.NoOpTracer()

# Tracer (instrumentation scope) names, one per process kind.
TRACER_INGRESS = "vtoken.ingress"
TRACER_ROUTER = "vtoken.router"
TRACER_REPLICA = "vtoken.replica"
TRACER_CONTROLLER = "vtoken.controller"

# Span names: one request's trace is ingress > admission, route, replica.generate.
SPAN_INGRESS = "vtoken.ingress"
SPAN_ROUTE = "vtoken.route"
SPAN_REPLICA_GENERATE = "vtoken.replica.generate"
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
ATTR_COMPLETION_TOKENS = "vtoken.request.completion_tokens"

# Span events of `SPAN_REPLICA_GENERATE` and their attributes.
EVENT_REQUEST_BUDGET = "vtoken.request_budget"
"""The request's own eviction budget (tokens, or a keep ratio), under `ATTR_BUDGET`."""
ATTR_BUDGET = "vtoken.budget"
EVENT_KV = "vtoken.kv"
"""What vToken did to the request's KV: one attribute per counter, `ATTR_KV_PREFIX + name`
(evicted_tokens, repack_moves, live_tokens, allocated_blocks, ideal_blocks)."""
ATTR_KV_PREFIX = "vtoken.kv."

# Metric names (instruments are created by the process that owns the meter).
METRIC_ADMISSIONS = "vtoken.admissions"
