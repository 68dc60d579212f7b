"""An exact replica: vLLM 0.32's own V1 ``Scheduler``, with vToken's patches, driven by a
fake executor that has no model.

Each ``step`` does what ``EngineCore.step`` does: ``schedule()``, "execute" (the fake
executor: a ``ModelRunnerOutput`` with one sampled token for every request whose scheduled
tokens reach the end of its sequence, as the V1 runner's ``discard_request_mask`` decides,
and the attention statistics the vToken worker would attach, from an
``AttentionSource``), then ``update_from_output()``. vLLM's chunked prefill, preemption
and prefix cache, the ``VTokenScheduler``, ``VTokenManager``, token tables,
``plan_repack`` and the policies run unchanged; only the forward pass is missing. The
step's duration is the caller's (``sim/cost_model.py``): the replica reports what it
scheduled (``StepRecord``) and what the repack would move.

The vLLM config is built by ``vllm.engine.arg_utils.EngineArgs`` from the same engine
arguments as the project's engines (``workers.engine.engine_args``) and a model folder
holding only ``config.json`` (``sim/model_configs.py``): the scheduler reads the model's
length limits and layer count, never its weights.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.attention import AttentionSource, SyntheticAttention
from workers.engine import CPU_ENV, engine_args
from workers.messages import OPS_ATTRIBUTE, SCORES_ATTRIBUTE, StepOps, StepScores
from workers.scheduler_side import VTokenScheduler


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """What one replica's engine is built with (the project's engine arguments).

    ``vtoken``: the engine's ``additional_config["vtoken"]`` (``None``: vanilla vLLM).
    """

    model_dir: str
    vtoken: dict[str, Any] | None
    num_blocks: int
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError(f"bad replica config: {self}")


def check_request(
    config: ReplicaConfig, request_id: str, prompt: Sequence[int], max_tokens: int
) -> None:
    """``ValueError`` for a request a replica of ``config`` cannot take: an empty prompt,
    ``max_tokens < 1``, or more tokens than ``max_model_len``."""
    if not prompt or max_tokens < 1:
        raise ValueError(f"request {request_id}: empty prompt or max_tokens < 1")
    if len(prompt) + max_tokens > config.max_model_len:
        raise ValueError(
            f"request {request_id}: {len(prompt)} + {max_tokens} tokens exceed"
            f" max_model_len {config.max_model_len}"
        )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step scheduled and returned: the cost model's input.

    ``prefill_tokens`` / ``decode_tokens``: scheduled tokens of requests still in their
    prompt / past it. ``context_tokens``: per scheduled request, the logical tokens its
    attention reads (vanilla's KV reads). ``live_tokens``: the physical (live) tokens
    vToken's attention reads. ``held_blocks``: blocks the scheduled requests hold after
    the step's allocation (Naive-Evict's masked reads). ``num_moves``: KV slots the
    repack copies before this step. ``scored``: requests whose statistics were computed.
    """

    prefill_tokens: int
    decode_tokens: int
    num_requests: int
    context_tokens: int
    live_tokens: int
    held_blocks: int
    attention_pairs: int
    num_moves: int
    scored_tokens: int
    finished: tuple[str, ...]
    first_tokens: tuple[str, ...]  # requests whose first output token this step made
    cached_tokens: dict[str, int] = field(default_factory=dict)  # of those: prefix hits
    num_output_tokens: dict[str, int] = field(default_factory=dict)


class ExactReplica:
    """One engine: vLLM's ``Scheduler`` (patched by vToken when ``config.vtoken``) and a
    fake executor. Not thread-safe; one instance per replica."""

    def __init__(self, config: ReplicaConfig, attention: AttentionSource | None = None) -> None:
        self.config = config
        self.scheduler = build_scheduler(config)
        self.attention = attention or self._synthetic()
        self.block_hasher = _block_hasher(self.scheduler.vllm_config, config.block_size)
        self.num_steps = 0
        self.outputs: dict[str, tuple[int, ...]] = {}  # the tokens a request will emit
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        original = self.scheduler._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.num_preemptions += 1
            self.recomputed_tokens += int(request.num_computed_tokens)
            return original(request, *args, **kwargs)

        self.scheduler._preempt_request = counting

    def _synthetic(self) -> SyntheticAttention:
        """Synthetic statistics shaped as this model's: scored layers x query heads."""
        vllm_config = self.scheduler.vllm_config
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        state = self.state
        num_layers = model.get_num_layers(parallel)
        layers = len(state.config.layer_ids(num_layers)) if state is not None else num_layers
        return SyntheticAttention(
            num_layers=layers, num_heads=model.get_num_attention_heads(parallel)
        )

    @property
    def state(self) -> VTokenScheduler | None:
        from workers.vllm_patches import scheduler_state

        return scheduler_state(self.scheduler)

    @property
    def num_free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        extra_args: dict[str, Any] | None = None,
        arrival_time: float = 0.0,
        output_tokens: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request that generates exactly ``max_tokens`` tokens (``ignore_eos``):
        ``output_tokens`` if given (a chat's next turn then finds them in the prefix
        cache), else the attention source's. ``extra_args`` as the engine takes them
        (``vtoken_policy``, ``tenant_weight``...), checked as the engine core checks them;
        ``cache_salt``: vLLM's, blocks are shared only within one salt."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        from workers.config import request_policy_spec
        from workers.fair_share import tenant_weight

        check_request(self.config, request_id, prompt, max_tokens)
        if output_tokens is not None:
            if len(output_tokens) != max_tokens:
                raise ValueError(f"request {request_id}: {len(output_tokens)} output tokens")
            self.outputs[request_id] = tuple(output_tokens)
        if self.state is not None:
            request_policy_spec(extra_args)
            tenant_weight(extra_args)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra_args
        )
        request = Request(
            request_id,
            list(prompt),
            params,
            None,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(request)

    def abort(self, request_ids: Sequence[str]) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def step(self) -> StepRecord | None:
        """One engine step (``None`` when nothing is left to schedule)."""
        if not self.scheduler.has_requests():
            return None
        scheduler = self.scheduler
        output = scheduler.schedule()
        ops: StepOps | None = getattr(output, OPS_ATTRIBUTE, None)
        record, runner_output = self._execute(output, ops)
        engine_outputs = scheduler.update_from_output(output, runner_output)
        self.num_steps += 1
        finished = tuple(
            o.request_id
            for outputs in engine_outputs.values()
            for o in outputs.outputs
            if o.finish_reason is not None
        )
        for request_id in finished:
            self.outputs.pop(request_id, None)
        return StepRecord(**{**record, "finished": finished})

    def _token(self, request_id: str, request: Any) -> int:
        planned = self.outputs.get(request_id)
        if planned is not None and request.num_output_tokens < len(planned):
            return planned[request.num_output_tokens]
        return self.attention.token(request_id, request.num_tokens)

    def _execute(self, output: Any, ops: StepOps | None) -> tuple[dict[str, Any], Any]:
        """The fake executor: what the V1 runner would return for ``output``."""
        from vllm.v1.outputs import ModelRunnerOutput

        scheduled = dict(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        state = self.state
        req_ids = list(scheduled)
        counts = step_counts(self.scheduler, state, scheduled, ops)
        sampled: list[list[int]] = []
        first: list[str] = []
        for request_id in req_ids:
            request = requests[request_id]
            if request.num_computed_tokens >= request.num_tokens:  # discard_request_mask
                sampled.append([self._token(request_id, request)])
                if request.num_output_tokens == 0:
                    first.append(request_id)
            else:
                sampled.append([])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        if state is not None and ops is not None:
            attention = {
                request_id: self.attention.statistics(
                    request_id,
                    state,
                    needs,
                    _live_tokens(state, request_id, requests[request_id].num_computed_tokens),
                    scheduled[request_id],
                    self.num_steps,
                )
                for request_id, needs in ops.score_needs.items()
                if request_id in scheduled
            }
            setattr(runner_output, SCORES_ATTRIBUTE, StepScores(attention))
        record = {
            **counts,
            "first_tokens": tuple(first),
            "cached_tokens": {r: _cached_tokens(requests[r]) for r in first},
            "num_output_tokens": {
                r: requests[r].num_output_tokens + len(s)
                for r, s in zip(req_ids, sampled, strict=True)
            },
        }
        return record, runner_output


def step_counts(
    scheduler: Any, state: VTokenScheduler | None, scheduled: dict[str, int], ops: StepOps | None
) -> dict[str, int]:
    """``StepRecord``'s counts of a step vLLM's ``scheduler`` has just scheduled (after
    ``schedule()``, before ``update_from_output()``): the same for a simulated replica
    and a real engine (``sim/cpu_profile.py`` times real steps against them)."""
    prefill = decode = context = live = held = pairs = 0
    for request_id, count in scheduled.items():
        request = scheduler.requests[request_id]
        done = request.num_computed_tokens  # already advanced by schedule()
        context += done
        in_prompt = done - count < request.num_prompt_tokens
        prefill += count if in_prompt else 0
        decode += 0 if in_prompt else count
        reads = _live_tokens(state, request_id, done)
        live += reads
        pairs += count * reads
        held += len(scheduler.kv_cache_manager.get_block_ids(request_id)[0])
    scored = 0
    if state is not None and ops is not None:
        scored = sum(
            _live_tokens(state, r, scheduler.requests[r].num_computed_tokens)
            for r in ops.score_needs
            if r in scheduled
        )
    return {
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "num_requests": len(scheduled),
        "context_tokens": context,
        "live_tokens": live,
        "held_blocks": held,
        "attention_pairs": pairs,
        "num_moves": ops.num_moves if ops is not None else 0,
        "scored_tokens": scored,
    }


def _cached_tokens(request: Any) -> int:
    """Prompt tokens vLLM's prefix cache served at the request's first scheduling."""
    stats = request.prefill_stats
    return int(stats.num_local_cached_tokens) if stats is not None else 0


def _live_tokens(state: VTokenScheduler | None, request_id: str, logical: int) -> int:
    """The tokens a request's attention reads this step: its live ones under vToken."""
    if state is None or not state.manages(request_id):
        return logical
    return int(state.manager.requests[request_id].table.num_live)


def build_scheduler(config: ReplicaConfig) -> Any:
    """vLLM's ``Scheduler`` for ``config``, vToken's patches installed, no executor."""
    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from workers.plugin import register

    register()
    if not (Path(config.model_dir) / "config.json").is_file():
        raise ValueError(f"{config.model_dir} has no config.json")
    args = engine_args(
        config.model_dir,
        config.vtoken,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        num_blocks=config.num_blocks,
        dtype="float32",
        enable_prefix_caching=config.enable_prefix_caching,
    )
    vllm_config = EngineArgs(
        **args,
        max_num_batched_tokens=config.max_num_batched_tokens,
        seed=0,
        skip_tokenizer_init=True,
    ).create_engine_config()
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    import torch

    spec = FullAttentionSpec(
        block_size=config.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=torch.float32,
    )
    num_layers = model.get_num_layers(parallel)
    kv_cache_config = KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(num_layers)], spec)
        ],
    )
    kv_cache_config.hash_block_size = config.block_size
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=config.block_size,
        hash_block_size=config.block_size,
        include_finished_set=False,
        log_stats=False,
    )


def _block_hasher(vllm_config: Any, block_size: int) -> Any:
    """vLLM's request block hasher, as ``EngineCore`` builds it (``None`` without caching)."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)
