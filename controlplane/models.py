"""Pydantic models for everything that crosses a process or network boundary.

Quotas are written by the admin API / CLI, reports by replicas, plans by the controller;
all of them travel through Redis. Bad values raise `pydantic.ValidationError` (a
`ValueError`) naming the field.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    StrictInt,
    WithJsonSchema,
    model_validator,
)

from controlplane.prefix import MAX_REPORTED_KEYS

TenantId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
"""1-128 characters: letters, digits, '.', '_', '-'; starts with a letter or digit."""

ReplicaId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:#-]{0,255}$")]
"""1-256 characters; also allows ':' and '#' so Ray Serve replica ids fit."""

NonNegativeInt = Annotated[int, Field(ge=0)]

_PREFIX_GROUP = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_prefix_group(name: str) -> str:
    """``name`` when it can name a prefix group (1-64 characters: letters, digits, '.',
    '_', '-'); ``ValueError`` saying so otherwise."""
    if not _PREFIX_GROUP.fullmatch(name):  # (re's `$` would let a final newline in)
        raise ValueError(
            f"a prefix group is 1-64 characters: letters, digits, '.', '_', '-' (got {name[:80]!r})"
        )
    return name


PrefixGroup = Annotated[
    str,
    AfterValidator(check_prefix_group),  # its own message, naming what a group name is
    WithJsonSchema({"type": "string", "pattern": f"^{_PREFIX_GROUP.pattern}$"}),
]
"""A prefix-cache sharing group's name (see ``TenantLimits.prefix_group``)."""


MAX_LIMIT = 2**31 - 1
"""The largest integer limit (blocks, requests, tokens): far above any cluster's, and exact
in the Lua scripts' doubles and the controller's float arithmetic."""
DEFAULT_QUEUE_DEPTH = 16
MAX_QUEUE_DEPTH = 10_000
DEFAULT_QUEUE_WAIT_S = 10.0
MAX_QUEUE_WAIT_S = 600.0
"""A queued request holds an HTTP connection and its prompt's ids at an ingress: a few
thousand per tenant and ten minutes bound that (the OpenAI client waits 600 s)."""
MIN_RATE = 0.01
"""The smallest prompt-token rate (tokens/s): a bucket refills within 2**31 ms."""


class _Frozen(BaseModel):
    # `Infinity`/`NaN` would pass `gt=0` and then fail to encode in a Lua script.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class TenantLimits(_Frozen):
    """A tenant's limits, declared once: the stored quota, the admin API's body and the
    CLI's fields all derive from this model. The controller and admission enforce them.

    `kv_budget_blocks` bounds the tenant's active KV across the whole cluster (the larger
    of the blocks replicas report and the reservations of admitted requests: each request's
    prefill peak until its prefill ends, then its steady bound).
    `eviction_budget_tokens`, when set, is the per-request keep budget the eviction policy
    enforces; it bounds a request's KV after prefill and, when the engines' prefill chunk
    is known, after each chunk of it (``controlplane.kv_bounds``).
    """

    # Upper bounds: a 310-digit budget once passed and overflowed the controller's float
    # arithmetic on every cycle; a rate of 1e-300 tokens/s made the bucket's expiry overflow.
    kv_budget_blocks: StrictInt = Field(gt=0, le=MAX_LIMIT)
    weight: float = Field(default=1.0, ge=1e-3, le=1000, allow_inf_nan=False)
    max_concurrent_requests: StrictInt | None = Field(default=None, gt=0, le=MAX_LIMIT)
    prompt_tokens_per_s: float | None = Field(default=None, ge=MIN_RATE, le=MAX_LIMIT)
    eviction_budget_tokens: StrictInt | None = Field(default=None, gt=0, le=MAX_LIMIT)
    squeeze_to_floor: bool = False
    """Count the tenant's running requests at their floors (what their policy protects,
    plus a block) instead of their budgets: more requests are admitted, and the tenant's
    requests absorb the difference by eviction below their budgets under pressure. Off by
    default: it trades answer quality for admission."""
    max_queue_depth: StrictInt = Field(default=DEFAULT_QUEUE_DEPTH, ge=0, le=MAX_QUEUE_DEPTH)
    """Requests of the tenant that may wait at the ingresses, cluster-wide, for its limits
    or the cluster to make room (``controlplane.fair_queue``); one more is a 429 with
    ``Retry-After``. 0: no queue (every such request is a 429 at once)."""
    max_queue_wait_s: float = Field(
        default=DEFAULT_QUEUE_WAIT_S, ge=0, le=MAX_QUEUE_WAIT_S, allow_inf_nan=False
    )
    """The longest a request waits in the queue; then it is a 429 with ``Retry-After``."""
    prefix_group: PrefixGroup | None = None
    """Tenants naming the same group share prefix-cache blocks: their prompts are salted
    with the group's salt instead of their own, so a prompt prefix one of them computed
    (a shared system prompt, few-shot examples) is a cache hit for the others on the same
    replica. Without a group a tenant's cached blocks are its own. Only tenants that may
    see each other's prompts should share a group: a cache hit's timing tells one tenant
    that another sent the same prefix."""


class _Tenant(_Frozen):
    tenant_id: TenantId


class TenantQuota(TenantLimits, _Tenant):
    """A tenant's stored limits (Redis hash `vtoken:quotas`, one JSON value per tenant).
    `tenant_id` comes first in its JSON (bases are laid out last to first)."""


class TenantUsage(_Frozen):
    """One tenant's footprint on one replica: `blocks` is its active KV there, `floor_blocks`
    what evicting its requests to their budgets would bring it to (`reclaimable_blocks`).

    `shared_blocks`: prefix-cache blocks its requests hold but another request pays for (a
    shared block is charged once, to its earliest current holder, whoever's tenant that
    is), counted per request: a block three of its requests hold and another pays for
    counts 3 times. They are not in `blocks`; a block two of its own requests share counts
    once in `blocks`, for the earlier one.

    `window_blocks`: of `blocks` (and of `floor_blocks`), those a hybrid model's
    sliding-window KV cache groups hold: never evicted, so pressure and allowances, which
    the engine enforces by evicting from the full-attention group, leave them out."""

    live_tokens: NonNegativeInt = 0
    blocks: NonNegativeInt = 0
    floor_blocks: NonNegativeInt = 0
    requests: NonNegativeInt = 0
    shared_blocks: NonNegativeInt = 0
    window_blocks: NonNegativeInt = 0

    @model_validator(mode="after")
    def _windows_within_floor(self) -> TenantUsage:
        if self.window_blocks > min(self.blocks, self.floor_blocks):
            raise ValueError(
                f"window_blocks ({self.window_blocks}) exceeds blocks ({self.blocks}) "
                f"or floor_blocks ({self.floor_blocks})"
            )
        return self

    @property
    def reclaimable_blocks(self) -> int:
        return max(0, self.blocks - self.floor_blocks)


class EngineCounters(_Frozen):
    """What an engine knows about its KV cache; the publisher's callable returns this.

    Invariants (validated): `free_blocks + used_blocks == total_blocks`;
    `reclaimable_blocks <= used_blocks` (held minus floor: what eviction to the requests'
    budgets and a repack give back without a preemption); the tenants' blocks sum to at
    most `used_blocks`. `preemptions` and `evictions_under_pressure` count since start.
    """

    block_size: int = Field(gt=0)
    total_blocks: int = Field(gt=0)
    free_blocks: NonNegativeInt
    used_blocks: NonNegativeInt
    live_tokens: NonNegativeInt = 0
    reclaimable_blocks: NonNegativeInt = 0
    queue_depth: NonNegativeInt = 0
    running_requests: NonNegativeInt = 0
    draining: bool = False
    blocks_reclaimed: NonNegativeInt = 0
    """Cumulative blocks returned to the pool by evictions and repacks while their requests
    were still running (since the engine started)."""
    naive_equivalent_blocks: NonNegativeInt = 0
    """Blocks the running requests would hold under Naive-Evict (same decisions)."""
    evictions_to_bound: NonNegativeInt = 0
    """Request-steps evicted to stay within what admission counts them at."""
    evictions_below_budget: NonNegativeInt = 0
    """Request-steps squeezed under their budgets instead of a preemption (among the
    evictions under pressure)."""
    evicted_tokens: NonNegativeInt = 0
    """Tokens evicted since the engine started (finished requests' too)."""
    repack_moves: NonNegativeInt = 0
    """Token copies (K and V, every layer) repacks made since the engine started."""
    repack_bytes: NonNegativeInt = 0
    """Bytes those copies read (as many written), since the engine started."""
    repack_seconds: float = Field(default=0.0, ge=0)
    """The copies' own time since the engine started (GPU: device time on the side
    stream, which overlaps host work; CPU: wall time of the synchronous copy)."""
    max_step_s: float = Field(default=0.0, ge=0)
    recent_steps: tuple[tuple[float, float], ...] = Field(default=(), max_length=64)
    """The engine's longest recent steps, ``(ended at, wall clock; seconds)``."""
    """The engine's longest recent step (see ``workers.scheduler_side.StepTimes``): how
    long its reports can lag what it holds."""
    preemptions: NonNegativeInt = 0
    evictions_under_pressure: NonNegativeInt = 0
    tenants: dict[TenantId, TenantUsage] = Field(default_factory=dict)
    tenant_counters: dict[TenantId, NonNegativeFloat] = Field(default_factory=dict)
    """Each tenant's virtual counter in this engine (weighted tokens served: prompt and
    output tokens at their costs, divided by the tenant's weight); the engine's waiting
    queue serves the smallest first. Empty when the engine's fairness is off."""
    prefix_keys: tuple[str, ...] = Field(default=(), max_length=MAX_REPORTED_KEYS)
    """Prefix keys (``controlplane/prefix.py``) of the blocks this replica's prefix cache
    was given, most recent first: what the router's prefix affinity matches."""

    @model_validator(mode="after")
    def _check_block_accounting(self) -> EngineCounters:
        if self.free_blocks + self.used_blocks != self.total_blocks:
            raise ValueError(
                f"free_blocks ({self.free_blocks}) + used_blocks ({self.used_blocks}) "
                f"must equal total_blocks ({self.total_blocks})"
            )
        if self.reclaimable_blocks > self.used_blocks:
            raise ValueError(
                f"reclaimable_blocks ({self.reclaimable_blocks}) exceeds "
                f"used_blocks ({self.used_blocks})"
            )
        tenant_blocks = sum(usage.blocks for usage in self.tenants.values())
        if tenant_blocks > self.used_blocks:
            raise ValueError(
                f"tenants hold {tenant_blocks} blocks, more than used_blocks ({self.used_blocks})"
            )
        return self

    @property
    def available_blocks(self) -> int:
        """Blocks a new request could get: free now plus reclaimable by eviction."""
        return self.free_blocks + self.reclaimable_blocks


class ReplicaReport(EngineCounters):
    """A replica's periodic report (Redis hash `vtoken:replica:<id>`, TTL a few periods)."""

    replica_id: ReplicaId
    engine_id: str = Field(default="", max_length=256)
    model_id: str = Field(default="", max_length=256)
    heartbeat_s: float = Field(ge=0)
    metrics_address: str = Field(default="", max_length=256)
    """``host:port`` of the replica's Prometheus endpoint (``GET /metrics``); empty: none."""


class ReplicaWeight(_Frozen):
    replica_id: ReplicaId
    weight: float = Field(gt=0, le=1)


class TenantRoute(_Frozen):
    """A tenant's warm set, best first; weights sum to 1."""

    replicas: tuple[ReplicaWeight, ...] = Field(min_length=1)
    usage_blocks: NonNegativeInt = 0
    over_budget: bool = False


class EvictionPressure(_Frozen):
    """A tighter keep budget for an over-budget tenant on one replica.

    The replica should shrink the tenant's KV there to about `target_blocks`
    (`keep_fraction` of what it reported; on a hybrid model, of what it reported outside
    the sliding-window groups, which are kept whole), evicting by its policy.
    """

    keep_fraction: float = Field(gt=0, le=1)
    target_blocks: NonNegativeInt


class RoutingPlan(_Frozen):
    """The controller's output, versioned; written under the controller lease.

    `version` grows by one each time the content changes (every field but the head:
    `version`, `fence`, `created_s`); the leader's heartbeat moves every cycle
    (`KeySpace.plan_heartbeat`). `fence` is the lease fencing token of the writer.
    `replica_ids` are the routable replicas; `drained_replica_ids` went stale or asked to
    drain and get no new requests. `pressure[replica_id][tenant_id]` is published for
    replicas to apply. `allowance[replica_id][tenant_id]` is the most blocks a tenant may
    hold on that replica (its share of the budget, in proportion to what it holds there;
    the shares sum to at most the budget): a replica evicts a tenant above its allowance
    to its requests' budgets at its next step, without waiting for the next plan.
    """

    version: NonNegativeInt
    fence: NonNegativeInt
    created_s: float = Field(ge=0)
    replica_ids: tuple[ReplicaId, ...] = ()
    drained_replica_ids: tuple[ReplicaId, ...] = ()
    tenants: dict[TenantId, TenantRoute] = Field(default_factory=dict)
    pressure: dict[ReplicaId, dict[TenantId, EvictionPressure]] = Field(default_factory=dict)
    allowance: dict[ReplicaId, dict[TenantId, NonNegativeInt]] = Field(default_factory=dict)

    def replica_slice_ids(self) -> frozenset[str]:
        """The replicas this plan has a :class:`PlanSlice` for: every one it names."""
        return frozenset(
            (*self.replica_ids, *self.drained_replica_ids, *self.pressure, *self.allowance)
        )

    def same_content(self, other: RoutingPlan) -> bool:
        """Whether ``other`` routes, drains, presses and allows exactly as this plan."""
        return all(
            getattr(self, name) == getattr(other, name)
            for name in type(self).model_fields
            if name not in ("version", "fence", "created_s")
        )


class PlanSlice(_Frozen):
    """One replica's part of a plan (Redis hash `vtoken:plan:slices`, field = replica id):
    what an engine applies, a few hundred bytes instead of the whole plan (1.5 MB and
    ~150 ms of parsing at 1,000 replicas x 10,000 tenants). `version` and `created_s` are
    those of the plan that last changed this slice; the slice is current as long as it is
    stored (the leader rewrites, adds and removes slices atomically with the plan)."""

    version: NonNegativeInt
    created_s: float = Field(ge=0)
    pressure: dict[TenantId, EvictionPressure] = Field(default_factory=dict)
    allowance: dict[TenantId, NonNegativeInt] = Field(default_factory=dict)
