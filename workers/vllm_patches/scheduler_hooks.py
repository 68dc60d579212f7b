"""Scheduler-side hooks (engine-core process): vLLM's ``Scheduler`` builds and drives a
``VTokenScheduler`` (``workers/scheduler_side.py``), and its ``KVCacheManager`` allocates
and frees through it.

Per step: ``schedule`` attaches the step's ``StepOps`` to the ``SchedulerOutput`` for the
workers; ``update_from_output`` lets policies evict and repacks commit, before vLLM's own
update (which may finish requests); ``allocate_slots`` turns physical counts into blocks,
adopting prefix-cache hits and publishing cacheable blocks; ``free`` releases a finished,
aborted or preempted request's table and ballast. Weighted fairness between tenants (the
waiting queues, the preemption order, the counters' charges) is ``fair_hooks.py``'s.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import workers.vllm_patches.fair_hooks as fair_hooks
from workers.config import parse_config
from workers.messages import OPS_ATTRIBUTE, SCORES_ATTRIBUTE
from workers.scheduler_side import VTokenScheduler
from workers.vllm_patches.kv_groups import group_layout
from workers.vllm_patches.sliding_groups import SlidingGroups
from workers.vllm_patches.support import check_engine, grouping_geometry, grouping_problems

logger = logging.getLogger(__name__)


def scheduler_state(scheduler: Any) -> VTokenScheduler | None:
    """The ``VTokenScheduler`` of a vLLM ``Scheduler`` (``None`` when vToken is off)."""
    # A custom ``SchedulerInterface`` may have no ``kv_cache_manager`` (vLLM reads it so).
    return getattr(getattr(scheduler, "kv_cache_manager", None), "vtoken", None)


def scheduler_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kw: Any):
        config = parse_config(vllm_config.additional_config)
        if config is not None:
            check_engine(vllm_config, type(self), kv_cache_config)
            config.layer_ids(len(group_layout(kv_cache_config).full_layer_names))
        original(self, vllm_config, kv_cache_config, *args, **kw)
        if config is None:
            return
        manager = self.kv_cache_manager
        layout = group_layout(kv_cache_config)
        single_type_manager = manager.coordinator.single_type_managers[layout.full_group]
        sliding = SlidingGroups(layout, manager.coordinator) if layout.hybrid else None
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        if type(single_type_manager) is not FullAttentionManager or self.defer_block_free:
            raise ValueError("vToken needs plain full attention without deferred block frees")
        if (
            manager.enable_caching
            and manager.block_pool.hash_block_size != single_type_manager.block_size
        ):
            raise ValueError(
                "vToken shares prefix-cache blocks whole: the prefix-cache hash block size "
                f"({manager.block_pool.hash_block_size}) must equal the block size "
                f"({single_type_manager.block_size})"
            )
        manager.vtoken = VTokenScheduler(
            config,
            manager.block_pool,
            single_type_manager,
            self.max_num_scheduled_tokens,
            grouping_geometry(vllm_config, config, hybrid=layout.hybrid),
            sliding,
        )
        manager.vtoken.grouping_problems = grouping_problems(vllm_config, config, layout.hybrid)
        fair_hooks.install_queues(self, manager.vtoken)
        logger.info("vToken active: %s", config.model_dump_json())

    return __init__


def schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = scheduler_state(self)
        if state is None:
            return original(self, *args, **kwargs)
        state.step_times.begin()  # the engine step: scheduling, forward, update
        with fair_hooks.before_schedule(self, state):
            output = original(self, *args, **kwargs)
        fair_hooks.after_schedule(self, state, output)
        on_demand = state.config.eviction == "on_demand"
        waiting = _waiting_head_blocks(self, state) if on_demand else 0
        ops = state.take_ops(output.num_scheduled_tokens, self.requests, waiting)
        setattr(output, OPS_ATTRIBUTE, ops)
        return output

    return schedule


def update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        state = scheduler_state(self)
        if state is not None:
            # Requests the scheduler side could not take in (``VTokenScheduler.refused``):
            # vLLM finishes them with an error in this update, as a failed grammar.
            self.grammar_compile_error_reqs.update(state.refused)
            state.refused.clear()
            scores = getattr(model_runner_output, SCORES_ATTRIBUTE, None)
            on_demand = state.config.eviction == "on_demand"  # the only reader of the victim
            above = fair_hooks.tenants_above_share(state) if on_demand else set()
            state.after_step(
                scheduler_output.num_scheduled_tokens,
                self.requests,
                scores,
                num_waiting_blocks=_waiting_head_blocks(self, state),
                victim_order=fair_hooks.running_order(self, state, above) if on_demand else (),
            )
        try:
            return original(self, scheduler_output, model_runner_output)
        finally:
            if state is not None:
                state.step_times.end()

    return update_from_output


def _waiting_head_blocks(scheduler: Any, state: VTokenScheduler) -> int:
    """Blocks the head of vLLM's waiting queue needs to start (its whole sequence less the
    prefix-cache hit blocks held already, plus vLLM's watermark), 0 when nothing waits."""
    if not scheduler.waiting:
        return 0
    head = scheduler.waiting.peek_request()
    manager = scheduler.kv_cache_manager
    needed = state.blocks_needed_for(min(head.num_tokens, scheduler.max_model_len))
    # Blocks of its cache hit that someone holds cost nothing (not with KV events on: the
    # lookup would report the hit again at every step).
    if manager.enable_caching and not manager.enable_kv_cache_events:
        hit, _, _ = manager.get_computed_blocks(head)
        full = hit.blocks[_full_group(state)] if hit.blocks else ()
        needed -= sum(1 for block in full if block.ref_cnt > 0)
    return needed + manager.watermark_blocks


def get_computed_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_computed_blocks(self: Any, request: Any) -> Any:
        """vLLM's prefix-cache hit, cut to what the request's policy allows
        (``VTokenScheduler.hit_limit``: caching never changes what a policy keeps)."""
        hit, num_hit, *rest = original(self, request)
        state: VTokenScheduler | None = getattr(self, "vtoken", None)
        if state is None or not num_hit:
            return (hit, num_hit, *rest)
        limit = state.hit_limit(request)
        if limit is None or num_hit <= limit:
            return (hit, num_hit, *rest)
        if state.sliding is not None:
            # A sliding group's hit holds only its window's blocks at the hit's end: cut
            # shorter, the window before the new end would be missing. No hit instead.
            return (self.empty_kv_cache_blocks, 0, *rest)
        kept = limit // state.block_size
        blocks = list(hit.blocks[0][:kept])
        return (self.create_kv_cache_blocks((blocks,)), kept * state.block_size, *rest)

    return get_computed_blocks


def allocate_slots(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def allocate_slots(self: Any, *args: Any, **kwargs: Any) -> Any:
        state: VTokenScheduler | None = getattr(self, "vtoken", None)
        if state is None:
            return original(self, *args, **kwargs)
        from vllm.v1.request import RequestStatus

        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        request = a["request"]
        unsupported = ("num_lookahead_tokens", "num_encoder_tokens", "num_external_computed_tokens")
        if any(a[name] for name in unsupported):
            raise RuntimeError(f"vToken: unsupported allocation {dict(a)}")
        hit = a["new_computed_blocks"]
        groups = hit.blocks if hit is not None and hit.blocks else ()
        hit_blocks = list(groups[_full_group(state)]) if groups else []
        if len(hit_blocks) * state.block_size != a["num_new_computed_tokens"]:
            raise RuntimeError(f"vToken: a prefix-cache hit of partial blocks {dict(a)}")
        reserve = a["reserved_blocks"]
        if a["has_scheduled_reqs"] and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        ):
            reserve += self.watermark_blocks
        if a["full_sequence_must_fit"] and not state.manages(request.request_id):
            needed = state.blocks_needed_for(min(request.num_tokens, self.max_model_len))
            needed -= sum(1 for block in hit_blocks if block.ref_cnt > 0)  # held already
            if needed + reserve > self.block_pool.get_num_free_blocks():
                return None
        per_group: tuple[list[Any], ...] | None
        if state.sliding is None:
            blocks = state.allocate(request, a["num_new_tokens"], reserve, hit_blocks)
            per_group = None if blocks is None else (blocks,)
        else:
            per_group = _allocate_hybrid(self, state, state.sliding, a, reserve, groups)
        if per_group is None:
            return None
        if self.enable_caching and not a["delay_cache_blocks"]:
            computed = request.num_computed_tokens + a["num_new_computed_tokens"]
            num_tokens = min(computed + a["num_new_tokens"], request.num_tokens)
            self.coordinator.cache_blocks(
                request, state.num_cacheable_tokens(request.request_id, num_tokens)
            )
        return self.create_kv_cache_blocks(per_group)

    return allocate_slots


def _full_group(state: VTokenScheduler) -> int:
    """The index of the KV cache group vToken's tables manage."""
    return 0 if state.sliding is None else state.sliding.layout.full_group


def _allocate_hybrid(
    manager: Any,
    state: VTokenScheduler,
    sliding: SlidingGroups,
    a: dict[str, Any],
    reserve: int,
    groups: tuple[Any, ...],
) -> tuple[list[Any], ...] | None:
    """A hybrid engine's step allocation, every group's new blocks (``None``: no room,
    nothing taken). As vLLM's coordinator does it: the blocks that left each window go
    back first, a hit's blocks are taken in every group before any new block is drawn
    (a new block may otherwise evict a cached hit block from the pool); the sliding
    groups with logical counts, the full-attention group through the token table."""
    request = a["request"]
    request_id = request.request_id
    computed = request.num_computed_tokens + a["num_new_computed_tokens"]
    num_tokens = min(computed + a["num_new_tokens"], manager.max_model_len)
    sliding.free_skipped(request, max(0, computed - request.num_in_flight_tokens))
    hits = sliding.hits_of(groups)
    needed = sliding.blocks_to_allocate(request_id, num_tokens, hits, computed)
    taken = any(hits)
    if taken:
        if needed + reserve > manager.block_pool.get_num_free_blocks():
            return None
        sliding.add_hits(request_id, hits, computed)
        needed = sliding.blocks_to_allocate(request_id, num_tokens, [[]] * len(hits), computed)
    full_hit = list(groups[sliding.layout.full_group]) if groups else []
    blocks = state.allocate(request, a["num_new_tokens"], reserve + needed, full_hit)
    if blocks is None:
        if taken:
            sliding.free(request_id)  # a request with a hit held nothing before it
        return None
    return sliding.per_group(blocks, sliding.allocate(request_id, num_tokens))


def free(original: Callable[..., Any]) -> Callable[..., Any]:
    def free(self: Any, request: Any) -> None:
        state: VTokenScheduler | None = getattr(self, "vtoken", None)
        if state is not None and state.fair is not None and request.is_finished():
            state.fair.forget(request.request_id)
        if state is not None and state.manages(request.request_id):
            # vLLM frees a preempted request while it is still RUNNING, a finished one after.
            state.free(request.request_id, preempted=not request.is_finished())
            if state.sliding is not None:
                state.sliding.free(request.request_id)
            return
        original(self, request)

    return free
