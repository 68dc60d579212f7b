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
ATTR_QUEUE_DEPTH = "vtoken.queue.depth"
"""The tenant's queued requests, cluster-wide, when this one joined (or was refused)."""
ATTR_QUEUE_WAIT_S = "vtoken.queue.wait_s"
ATTR_QUEUE_OUTCOME = "vtoken.queue.outcome"
"""How a queued request's wait ended: admitted, rejected, timeout, full (not queued: its
tenant's queue was full), left (its client went away), lost (its ticket lapsed)."""
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
"""Ingress admission decisions (counter; attributes `ATTR_TENANT_ID`,
`ATTR_ADMISSION_OUTCOME`: admitted, throttled, rejected): throttles are its `throttled` series."""

# OpenTelemetry metrics (`controlplane/otel_metrics.py` creates the instruments). The meter
# names are the tracer names: one instrumentation scope per process kind. Block and token
# counts carry a `{block}` / `{token}` unit (annotations: Prometheus names get no suffix);
# durations are in `s` (Prometheus names end in `_seconds`); counters end in `_total`.
METRIC_REPLICA_KV_BLOCKS = "vtoken.replica.kv.blocks"
"""Gauge: one replica's KV blocks by `ATTR_BLOCK_STATE` (`BLOCK_STATES`)."""
ATTR_BLOCK_STATE = "vtoken.block.state"
BLOCK_STATES = ("total", "free", "held", "floor", "reclaimable")
"""`held`: allocated to running requests (active KV); `floor`: what evicting every request
to its budget and a repack would leave; `reclaimable`: held - floor."""
METRIC_REPLICA_LIVE_TOKENS = "vtoken.replica.kv.live_tokens"
METRIC_REPLICA_RUNNING_REQUESTS = "vtoken.replica.requests.running"
METRIC_REPLICA_BLOCKS_RECLAIMED = "vtoken.replica.kv.blocks_reclaimed"
"""Counter: blocks evictions and repacks gave back while their requests still ran."""
METRIC_REPLICA_PREEMPTIONS = "vtoken.replica.preemptions"
METRIC_REPLICA_EVICTIONS_UNDER_PRESSURE = "vtoken.replica.evictions_under_pressure"
METRIC_REPLICA_EVICTIONS_BELOW_BUDGET = "vtoken.replica.evictions_below_budget"
"""Counter: request-steps squeezed under their budgets instead of a preemption (among the
evictions under pressure)."""
METRIC_REPLICA_EVICTED_TOKENS = "vtoken.replica.kv.evicted_tokens"
"""Counter: tokens the policies evicted on one replica since its engine started."""
METRIC_REPLICA_REPACK_MOVES = "vtoken.replica.kv.repack_moves"
"""Counter: token copies (K and V, every layer) the repacks planned on one replica."""
METRIC_REPLICA_REPACK_BYTES = "vtoken.replica.kv.repack"
"""Counter (bytes): what the worker's repacks copied on one replica (read; as many
written); with tensor parallelism, one rank's shard (every rank copies as much). Moves
planned after a replica's last step never run: they are not here."""
METRIC_REPLICA_REPACK_DURATION = "vtoken.replica.kv.repack_duration"
"""Counter (s): the repack copies' own time: device time on the side stream on GPUs
(overlapping host work), wall time of the synchronous copy on CPU."""
METRIC_REPLICA_STEP_DURATION = "vtoken.replica.engine.step_max"
"""Gauge (s): the engine's longest step (`schedule` through `update_from_output`) of the
last two seconds."""
METRIC_REPLICA_TENANT_KV_BLOCKS = "vtoken.replica.tenant.kv.blocks"
"""Gauge: a tenant's active KV on one replica (`ATTR_TENANT_ID`, `ATTR_REPLICA_ID`)."""
METRIC_TENANT_KV_ACTIVE = "vtoken.tenant.kv.active_blocks"
"""Gauge: a tenant's active KV across the cluster, as the controller's last plan measured it."""
METRIC_TENANT_KV_BUDGET = "vtoken.tenant.kv.budget_blocks"
"""Gauge: a tenant's active-KV budget (its quota's `kv_budget_blocks`)."""
METRIC_PLAN_AGE = "vtoken.controller.plan.age"
"""Gauge (s): now minus the current plan's `created_s`; grows when no controller plans."""
METRIC_CONTROLLER_CYCLE_DURATION = "vtoken.controller.cycle.duration"
"""Histogram (s): one leader cycle (read reports and quotas, plan, write)."""
METRIC_QUEUE_WAIT = "vtoken.queue.wait"
"""Histogram (s), per `ATTR_TENANT_ID`: how long a queued request waited at the ingress."""
METRIC_QUEUE_DEPTH = "vtoken.queue.depth"
"""Gauge, per `ATTR_TENANT_ID`: requests this ingress holds queued."""
METRIC_QUEUE_OLDEST_WAIT = "vtoken.queue.oldest_wait"
"""Gauge (s), per `ATTR_TENANT_ID`: how long the oldest of them has waited."""
METRIC_TIME_TO_FIRST_TOKEN = "vtoken.request.time_to_first_token"
"""Histogram (s), per `ATTR_TENANT_ID`: arrival at the ingress to the first token."""
METRIC_TIME_PER_OUTPUT_TOKEN = "vtoken.request.time_per_output_token"
"""Histogram (s), per `ATTR_TENANT_ID`: (last token - first token) / (tokens - 1)."""

# Spans of the engine path (inside `SPAN_REPLICA_GENERATE`) and of the report publisher.
SPAN_ENGINE_FIRST_TOKEN = "vtoken.engine.first_token"
"""From the replica handing the request to vLLM to its first output (queue + prefill);
vLLM's own `llm_request` span joins the same trace through `trace_headers`."""
ATTR_REPORT_FREE_BLOCKS = "vtoken.report.free_blocks"
ATTR_REPORT_RECLAIMABLE_BLOCKS = "vtoken.report.reclaimable_blocks"
ATTR_REPORT_NUM_TENANTS = "vtoken.report.num_tenants"
