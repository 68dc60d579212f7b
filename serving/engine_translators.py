"""Translations between one engine (vLLM with vToken) and the control plane: the engine's
report as the control plane's counters, a tenant's cap as a per-request policy override,
vLLM's log-probabilities as the chunk carries them, the ids the engine core knows a
request's sequences by, and how many prompt blocks the engine keeps cached. Pure: no
engine, no Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from controlplane.models import EngineCounters, TenantUsage
from controlplane.openai_models import TokenLogprob
from controlplane.prefix import MAX_REPORTED_KEYS
from policies import CAP_POLICY
from serving.settings import ReplicaSettings
from vtoken.reports import EngineReport
from workers.config import REQUEST_KEY, VTokenConfig, request_policy_spec

MIN_LOGPROB = -9999.0  # what vLLM's OpenAI server answers for -inf (JSON has no infinity)


def published_blocks(settings: ReplicaSettings, extra_args: dict[str, Any] | None) -> int:
    """How many leading blocks of a request's prompt its engine is expected to keep in the
    prefix cache (``workers/prefix_cache.py``): a request publishes every full block
    until it first evicts, then keeps those below its first eviction and never fewer than
    its pinned prefix (``prefix_pin_tokens``). So: all of them under a policy that never
    evicts or when evicting on demand (it evicts only when memory runs short), the pinned
    prefix when evicting eagerly (from its first decoding step, or its first prefill chunk
    under a policy that evicts during prefill); none with caching off."""
    if not settings.enable_prefix_caching:
        return 0
    engine = settings.vtoken
    spec = request_policy_spec(extra_args) or engine
    if not spec.make_policy().evicts or engine.eviction == "on_demand":
        return MAX_REPORTED_KEYS  # all of them (a request carries fewer keys)
    return engine.prefix_pin_tokens // settings.block_size


def counters_from_snapshot(
    report: EngineReport, running: int, prefix_keys: Sequence[str] = ()
) -> EngineCounters:
    """The control plane's counters (its report schema) from the engine's ``EngineReport``:
    the one place the two meet; every total is the engine report's own. ``prefix_keys``:
    what the replica's prefix cache was given, most recent first.

    A tenant's active KV (``blocks``, what quotas, the plan, pressure and allowances
    compare to budgets) and its floor count every KV cache group: on a hybrid model its
    requests' sliding-window blocks too (``KVUsage.held_blocks_all_groups``,
    ``floor_blocks_all_groups``), which eviction never takes, so what is reclaimable is
    the full-attention group's alone. The pool is one for every group: ``used_blocks``
    (total - free) counts them all."""
    shared: dict[str, int] = {}
    for request in report.requests:
        shared[request.tenant] = shared.get(request.tenant, 0) + request.shared_blocks
    return EngineCounters(
        prefix_keys=tuple(prefix_keys),
        block_size=report.block_size,
        total_blocks=report.total_blocks,
        free_blocks=report.free_blocks,
        used_blocks=report.total_blocks - report.free_blocks,
        live_tokens=report.total.live_tokens,
        reclaimable_blocks=report.total.reclaimable_blocks,
        running_requests=running,
        blocks_reclaimed=report.blocks_reclaimed,
        naive_equivalent_blocks=report.total.naive_blocks,
        preemptions=report.num_preemptions,
        evictions_under_pressure=report.num_evictions_under_pressure,
        max_step_s=report.recent_max_step_s,
        recent_steps=report.recent_steps,
        evicted_tokens=report.evicted_tokens_total,
        evictions_to_bound=report.num_evictions_to_bound,
        evictions_below_budget=report.num_evictions_below_budget,
        repack_moves=report.repack_moves_total,
        repack_bytes=report.repack_bytes_total,
        repack_seconds=report.repack_seconds_total,
        tenant_counters=report.tenant_counters,
        tenants={
            tenant: TenantUsage(
                live_tokens=usage.live_tokens,
                blocks=usage.held_blocks_all_groups,
                floor_blocks=usage.floor_blocks_all_groups,
                window_blocks=usage.window_blocks,
                requests=usage.num_requests,
                shared_blocks=shared.get(tenant, 0),
            )
            for tenant, usage in report.tenants.items()
        },
    )


def request_spec(engine: VTokenConfig, budget_tokens: int | None) -> dict[str, Any] | None:
    """A per-request override of the engine's vToken spec (``extra_args["vtoken_policy"]``).

    ``budget_tokens`` is the tenant's per-request KV cap (``TenantQuota.
    eviction_budget_tokens``, which admission counted on): it becomes the request's token
    budget, under the engine's policy when that policy instance holds its budget every step
    and protects fewer tokens than the cap (SnapKV and PAGE compress once, ``none`` never
    evicts, StreamingLLM with a fixed window keeps it), else under ``policies.CAP_POLICY``.
    ``None``: nothing to override. Controller pressure is not applied here: the engine
    applies it to every running request of the tenant (``EngineHost.apply_pressure``). A
    cap that makes no valid spec (e.g. 0 tokens) raises ``ValueError``: the request is
    refused (HTTP 400), never run without its cap.
    """
    if budget_tokens is None:
        return None
    policy = engine.make_policy()
    # This instance must hold a budget every step and protect fewer tokens than the cap
    # (StreamingLLM with a fixed window limits itself and would keep its window).
    holds_cap = (
        policy.holds_budget_every_step
        and policy.needs_budget
        and policy.protection().tokens < budget_tokens
    )
    override: dict[str, Any]
    if holds_cap:
        override = {"policy": engine.policy, "policy_args": engine.policy_args}
    else:
        override = {"policy": CAP_POLICY.name}
    override["budget_tokens"] = budget_tokens
    request_policy_spec({REQUEST_KEY: override})  # raises ValueError when it is bad
    return override


def token_logprobs(
    token_ids: Sequence[int], steps: Sequence[Any] | None, decode: Callable[[int], str]
) -> list[TokenLogprob]:
    """The engine's log-probabilities of ``token_ids`` (vLLM's ``CompletionOutput.logprobs``:
    per token a dict of token id -> ``Logprob``, the sampled token first) as the chunk
    carries them; ``decode`` names a token the engine did not decode."""
    entries = []
    for position, token_id in enumerate(token_ids):
        step = steps[position] if steps is not None and position < len(steps) else None
        chosen = step.get(token_id) if step else None
        if step is None or chosen is None:  # the engine gave none: the token alone
            entries.append(TokenLogprob(token=decode(token_id)))
            continue
        top = [
            (lp.decoded_token or decode(other), max(lp.logprob, MIN_LOGPROB))
            for other, lp in step.items()
        ]
        token = chosen.decoded_token or decode(token_id)
        entries.append(TokenLogprob(token=token, logprob=max(chosen.logprob, MIN_LOGPROB), top=top))
    return entries


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """The ids the engine core knows a request's sequences by, up to vLLM's ``-<8 chars>``
    suffix (which ``request_report`` matches): the request's own id, or with ``n > 1``
    one child per choice, ``<index>_<id>`` (vLLM's ``ParentRequest.get_child_info``)."""
    if n == 1:
        return [request_id]
    return [f"{index}_{request_id}" for index in range(n)]
