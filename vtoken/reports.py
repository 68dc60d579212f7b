"""Report models: what a request, a tenant and an engine hold, and what a repack gives back.

One family, each number computed once: a request's counts come from its token table
(``VTokenManager.report``); a tenant's and the engine's are sums of request reports
(``EngineReport.tenants`` and ``EngineReport.total``, the only places totals are taken);
``reclaimable_blocks`` is ``allocated - floor`` at every level (``KVUsage``).

Pydantic models because an engine report crosses processes: vLLM's engine core dumps it
to plain data for its utility call, the caller validates it back (``workers/api.py``);
``serving/engine_translators.py`` maps it to the control plane's report schema.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vtoken.repack_planner import ReclaimMode

DEFAULT_TENANT = "default"
"""The tenant of a request that names none (an engine used without the serving layer).
Defined here, the lowest package every user of it may import (``workers`` and
``serving``; ``controlplane`` never needs it)."""

Count = Annotated[int, Field(ge=0)]


class KVUsage(BaseModel):
    """What some requests hold in the KV cache: one request, a tenant's, an engine's.

    ``allocated_blocks`` are held from the pool (Naive-Evict's ballast included): a
    request's **active KV**; ``ideal_blocks`` is ``ceil(live_tokens / block_size)`` per
    request, what a repack brings ``allocated_blocks`` down to; ``floor_blocks`` what
    eviction to the request's budget then a repack would bring it to now (its ideal when it
    has no budget or is at it); ``naive_blocks`` what Naive-Evict would hold on the same
    decisions (one block per logical block with a live token). ``reclaimable_blocks`` is
    ``allocated - floor``: what the engine can give back without preempting anything.
    A request that keeps a set per layer or (layer, KV head) (``vtoken/groups.py``)
    counts ``evicted_tokens`` per group (every group evicts as many) and a ``repack_moves``
    per group moved (one layer's, or one head's, part of a slot).

    A hybrid model's sliding-window KV cache groups (kept by vLLM, never evicted from)
    hold ``window_blocks`` beside these: their held blocks are their floor, none
    reclaimable; ``held_blocks_all_groups`` and ``floor_blocks_all_groups`` count every
    group (the counts above are the full-attention group's).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_requests: Count = 0
    live_tokens: Count = 0
    allocated_blocks: Count = 0
    ideal_blocks: Count = 0
    floor_blocks: Count = 0
    naive_blocks: Count = 0
    evicted_tokens: Count = 0
    repack_moves: Count = 0
    window_blocks: Count = 0

    @model_validator(mode="before")
    @classmethod
    def _floor_defaults_to_ideal(cls, data: Any) -> Any:
        if isinstance(data, dict) and "floor_blocks" not in data:
            return {**data, "floor_blocks": data.get("ideal_blocks", 0)}
        return data

    @property
    def reclaimable_blocks(self) -> int:
        return self.allocated_blocks - self.floor_blocks

    @property
    def held_blocks_all_groups(self) -> int:
        return self.allocated_blocks + self.window_blocks

    @property
    def floor_blocks_all_groups(self) -> int:
        return self.floor_blocks + self.window_blocks

    def __add__(self, other: KVUsage) -> KVUsage:
        return KVUsage(**{name: getattr(self, name) + getattr(other, name) for name in _SUMMED})


_SUMMED = tuple(KVUsage.model_fields)


class RequestReport(KVUsage):
    """One request's usage; ``policy`` is ``None`` when the engine evicts explicit ids.

    ``shared_blocks``: blocks it holds that are charged to another request (prefix-cache
    blocks several requests share are charged once, to their earliest current holder:
    ``VTokenManager.charged_elsewhere``); its block counts exclude them, so a tenant's
    and the engine's sums count every block once."""

    request_id: str
    tenant: str = DEFAULT_TENANT
    policy: str | None = None
    finished: bool = False
    num_requests: Count = 1
    shared_blocks: Count = 0


class EngineReport(BaseModel):
    """What one engine holds: its pool, its counters, and its running requests.

    ``blocks_reclaimed`` counts the blocks evictions and repacks gave back while their
    requests still ran (since the engine started). Tenant and engine totals are sums of
    ``requests``, computed when read (a property, so a ``model_copy`` never carries stale
    totals) and never sent.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: ReclaimMode
    policy: str
    block_size: int = Field(gt=0)
    total_blocks: Count
    free_blocks: Count
    num_preemptions: Count = 0
    num_evictions_under_pressure: Count = 0
    num_evictions_to_bound: Count = 0
    """Request-steps evicted to stay within what admission counts them at."""
    num_evictions_below_budget: Count = 0
    """Request-steps squeezed under their budgets so that vLLM need not preempt (among the
    evictions under pressure)."""
    shared_copies: Count = 0
    """Blocks another request also held that a request copied to evict from (copy on
    evict: the copy is its own block, the shared one stays intact), since start."""
    copies_deferred: Count = 0
    """Request-steps that evicted but kept their shared blocks, no free block being left
    for the copies (protected that step, as if pinned)."""
    blocks_reclaimed: Count = 0
    evicted_tokens_total: Count = 0
    repack_moves_total: Count = 0
    repack_bytes_total: Count = 0
    """Bytes the worker's repacks copied (read; as many written), every layer, since start
    (tensor parallelism: the driver rank's shard; every rank copies as much)."""
    repack_seconds_total: float = Field(default=0.0, ge=0)
    """The repack copies' own time since start (CPU: wall; CUDA: side-stream events)."""
    recent_max_step_s: float = Field(default=0.0, ge=0)
    """The longest engine step (``schedule`` through ``update_from_output``) that ended in
    the last two seconds."""
    recent_steps: tuple[tuple[float, float], ...] = ()
    """The longest steps of those two seconds: ``(ended at, wall clock; seconds)``."""
    tenant_counters: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    """Each tenant's virtual counter (weighted tokens served here, ``workers/fair_share.py``;
    empty with fairness off): the tenant with the smallest is served first."""
    requests: tuple[RequestReport, ...] = ()

    @property
    def tenants(self) -> dict[str, KVUsage]:
        totals: dict[str, KVUsage] = {}
        for request in self.requests:
            totals[request.tenant] = totals.get(request.tenant, KVUsage()) + request
        return totals

    @property
    def total(self) -> KVUsage:
        return sum(self.requests, KVUsage())
