"""Worker-side hooks (every worker process; the V1 ``GPUModelRunner``, which vLLM's CPU
runner subclasses): each runner builds one ``VTokenWorker`` (``workers/worker_side.py``)
that repacks and truncates (block mode: rewrites) block rows before the forward, makes
what attention reads physical, and scores the queries its attention layers hand over
after it.

Per step: ``execute_model`` runs the step's ``StepOps`` before the forward and scores
after it; ``prepare_inputs`` makes ``seq_lens`` and the slot mapping physical;
``attention_forward`` hands a scored layer's queries to the worker; ``sample_tokens``
attaches the ``StepScores`` to the ``ModelRunnerOutput``. On CUDA,
``initialize_kv_cache`` builds and checks the worker at start.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import workers.vllm_patches.group_lengths as group_lengths
from kernels import KVLayout
from workers.config import VTokenConfig, parse_config
from workers.messages import OPS_ATTRIBUTE, SCORES_ATTRIBUTE
from workers.query_capture import QueryCapture, capture_size, to_device
from workers.tensor_parallel import RankReduction
from workers.vllm_patches.cuda import FLASHINFER_IMPL, FP8_CACHE_DTYPES, cuda_key_dtype
from workers.vllm_patches.fp8_queries import query_conversion
from workers.vllm_patches.group_lengths import LENGTHS_ATTRIBUTE as LENGTHS
from workers.vllm_patches.kv_groups import group_layout, layer_index
from workers.vllm_patches.support import (
    SUPPORTED_RUNNERS,
    WHERE_VTOKEN_RUNS,
    UnsupportedEngineError,
    check_engine,
    qualname,
)
from workers.worker_side import ScoredRequest, VTokenWorker

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
CAPTURE_ATTRIBUTE = "vtoken_query_capture"  # the runner's QueryCapture, from load_model
GROUP_ATTRIBUTE = "vtoken_full_group"  # the KV cache group vToken manages, once known


def worker_state(runner: Any) -> VTokenWorker | None:
    """The runner's ``VTokenWorker``, created on first use (``None`` when vToken is off)."""
    if hasattr(runner, "vtoken"):
        return runner.vtoken
    config = parse_config(runner.vllm_config.additional_config)
    runner.vtoken = None if config is None else _make_worker(runner, config)
    return runner.vtoken


@dataclass(frozen=True, slots=True)
class LayerCapture:
    """What an attention layer's wrapped ``forward`` hands its worker: the worker, the
    layer's index, and the float8 dtype an fp8 KV cache (uint8 storage) is read as
    (``None``: the cache is read in its own dtype), and whether the layer's impl quantizes
    queries to fp8 itself before its logits (FlashInfer over an fp8 cache)."""

    state: VTokenWorker
    layer_id: int
    key_dtype: torch.dtype | None = None
    flashinfer_fp8_query: bool = False  # a FlashInfer layer that quantizes its queries


def _make_worker(runner: Any, config: VTokenConfig) -> VTokenWorker:
    # Defence in depth: the scheduler side refused unsupported engines at start; a
    # runner that still reaches this point must be the one these hooks were written for.
    vllm_config = runner.vllm_config
    check_engine(vllm_config, vllm_config.scheduler_config.get_scheduler_cls())
    device = runner.device.type
    if qualname(type(runner)) != SUPPORTED_RUNNERS.get(device):
        raise UnsupportedEngineError(
            f"vToken cannot run in model runner {qualname(type(runner))} on"
            f" {device!r}. {WHERE_VTOKEN_RUNS}"
        )
    attention = attention_layers(runner)
    check_positions(attention)
    if device == "cpu":
        layout, key_dtype = _cpu_layout(attention), None
    else:
        layout, key_dtype = KVLayout.BHNC, cuda_key_dtype(runner, attention)
    ranks = RankReduction.of_vllm_group(vllm_config.parallel_config.tensor_parallel_size)
    capture = getattr(runner, CAPTURE_ATTRIBUTE, None) or _allocate_capture(runner, config)
    state = VTokenWorker(config, layout, capture, ranks)
    groups = group_layout(runner.kv_cache_config)
    if groups.hybrid:
        if device != "cpu":
            raise UnsupportedEngineError(
                "vToken runs hybrid (sliding-window) models on vLLM's CPU attention only:"
                f" on {device!r} the full-attention group's lengths are not wired"
            )
        group_lengths.attach(runner, groups.full_group)
    flashinfer = _flashinfer_query_scale(runner)
    for name, layer in attention.items():
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise ValueError(f"vToken: cannot read a layer index from {name!r}")
        quantized = flashinfer and qualname(type(layer.impl)) == FLASHINFER_IMPL
        layer.vtoken_capture = LayerCapture(state, int(match.group(1)), key_dtype, quantized)
    return state


def attention_layers(runner: Any) -> dict[str, Any]:
    """The runner's attention layers by name (those with an ``impl``)."""
    layers = runner.vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in layers.items() if hasattr(layer, "impl")}


def check_positions(attention: dict[str, Any]) -> None:
    """Refuse ALiBi models: their bias grows with the distance between key and query
    indices, which a repack makes physical (a kept key moves closer to the query), so the
    attention would change; RoPE positions stay logical and are unaffected."""
    alibi = [name for name, layer in attention.items() if _has_alibi(layer.impl)]
    if alibi:
        raise UnsupportedEngineError(
            f"vToken cannot run a model with ALiBi attention ({alibi[0]} and"
            f" {len(alibi) - 1} more layers): ALiBi biases logits by the distance between"
            " key and query slots, and a repack moves kept keys closer, changing the"
            " model's attention. Use a RoPE model, or serve this one without"
            " additional_config['vtoken']"
        )


def _has_alibi(impl: Any) -> bool:
    return getattr(impl, "alibi_slopes", None) is not None or bool(getattr(impl, "alibi", False))


def _allocate_capture(runner: Any, config: VTokenConfig) -> QueryCapture:
    """The capture buffer of ``workers/query_capture.py`` on the runner's device."""
    layer_ids = scored_layer_ids(attention_layers(runner), config)
    size = capture_size(runner.vllm_config, len(layer_ids))
    return QueryCapture(size, layer_ids, runner.device)


def scored_layer_ids(attention: dict[str, Any], config: VTokenConfig) -> list[int]:
    """The layers whose queries score tokens: ``config.score_layers`` counted over the
    full-attention layers only (a hybrid model's sliding-window layers keep their window
    and never see what vToken evicts; their caches hold nothing its block rows name)."""
    full = sorted(
        index
        for name, layer in attention.items()
        if getattr(layer, "sliding_window", None) is None
        and (index := layer_index(name)) is not None
    )
    return [full[i] for i in config.layer_ids(len(full))]


def load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """``load_model`` of the V1 runner and the CPU runner: with a vToken config, refuse
    ALiBi models and allocate the capture buffer right after the model exists, before
    vLLM's profiling run measures what the KV pool may take (so the pool accounts for
    it: ``workers/query_capture.py`` has its size)."""

    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = parse_config(self.vllm_config.additional_config)
        if config is None:
            return
        check_positions(attention_layers(self))
        if getattr(self, CAPTURE_ATTRIBUTE, None) is None:
            setattr(self, CAPTURE_ATTRIBUTE, _allocate_capture(self, config))

    return load_model


def _flashinfer_query_scale(runner: Any) -> bool:
    """Whether FlashInfer layers quantize queries to fp8 for their logits (an fp8 cache:
    FlashInfer then scores ``scale * q_scale * k_scale * fp8(q / q_scale) . k``)."""
    return runner.vllm_config.cache_config.cache_dtype in FP8_CACHE_DTYPES


def _cpu_layout(attention: dict[str, Any]) -> KVLayout:
    """The layout vLLM's CPU_ATTN writes, from the layers' one ``isa``."""
    isas = {getattr(layer, "isa", None) for layer in attention.values()}
    isa = next(iter(isas)) if len(isas) == 1 else None
    if not isinstance(isa, str):
        raise ValueError(f"vToken: cannot tell the CPU attention isa of the layers: {isas}")
    return KVLayout.for_cpu_isa(isa)


def initialize_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner.initialize_kv_cache``: on CUDA, build the worker as soon as the
    KV cache exists (not at the first step, as on CPU), so that the checks of
    ``cuda_key_dtype`` against the engine's layers, caches and attention implementations
    refuse an engine the CUDA hooks do not cover at start, before it reports ready."""

    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, kv_cache_config, *args, **kwargs)
        profiling = kwargs.get("is_profiling", args[0] if args else False)
        if self.device.type != "cpu" and not profiling:
            self.__dict__.pop("vtoken", None)  # built against the caches just allocated
            worker_state(self)

    return initialize_kv_cache


def execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        state = worker_state(self)
        ops = getattr(scheduler_output, OPS_ATTRIBUTE, None)
        if state is None or ops is None:
            return original(self, scheduler_output, *args, **kwargs)
        _truncate_blocks(self, ops.num_blocks)
        _rewrite_blocks(self, ops.block_rows)
        state.begin_step(ops, self.kv_caches)
        output = original(self, scheduler_output, *args, **kwargs)
        state.launch_scores(_scored_requests(self))
        if _is_runner_output(output):  # no sampling step follows
            _attach_scores(state, output)
        return output

    return execute_model


def full_group(runner: Any) -> int:
    """The KV cache group vToken manages (``kv_groups.GroupLayout.full_group``): a hybrid
    model's full-attention group; the sliding-window groups' rows stay vLLM's."""
    if not hasattr(runner, GROUP_ATTRIBUTE):
        setattr(runner, GROUP_ATTRIBUTE, group_layout(runner.kv_cache_config).full_group)
    return int(getattr(runner, GROUP_ATTRIBUTE))


def _truncate_blocks(runner: Any, num_blocks: dict[str, int]) -> None:
    """Cut the tail blocks a repack emptied from the cached state and the batch row."""
    batch = runner.input_batch
    group = full_group(runner) if num_blocks else 0
    for request_id, count in num_blocks.items():
        request = runner.requests.get(request_id)
        if request is None:
            continue
        block_ids = request.block_ids[group]
        del block_ids[count:]
        row = batch.req_id_to_index.get(request_id)
        if row is not None:
            table = batch.block_table[group]
            num_before = int(table.num_blocks_per_row[row])
            table.block_table.np[row, count:num_before] = 0  # no stale ids past the count
            table.num_blocks_per_row[row] = count


def _rewrite_blocks(runner: Any, block_rows: dict[str, np.ndarray]) -> None:
    """Block mode: replace a request's block list (blocks dropped from its middle, no KV
    moved) in the cached state and the batch row; vLLM commits the host row to the
    device with the step's other block-table changes."""
    batch = runner.input_batch
    group = full_group(runner) if block_rows else 0
    table = batch.block_table[group]
    for request_id, row in block_rows.items():
        request = runner.requests.get(request_id)
        if request is None:
            continue
        block_ids = request.block_ids[group]
        block_ids[:] = row.tolist()
        index = batch.req_id_to_index.get(request_id)
        if index is not None:
            num_before = int(table.num_blocks_per_row[index])
            table.block_table.np[index, : row.size] = row
            table.block_table.np[index, row.size : num_before] = 0
            table.num_blocks_per_row[index] = row.size


def _scored_requests(runner: Any) -> list[ScoredRequest]:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = runner.query_start_loc.np[: num_reqs + 1]
    # The host copy, physical after the ``_prepare_inputs`` hook and exact without spec
    # decoding: reading the device copy would wait for the forward on CUDA.
    seq_lens = runner.optimistic_seq_lens_cpu[:num_reqs].numpy()
    hybrid: group_lengths.FullGroupLengths | None = getattr(runner, LENGTHS, None)
    if hybrid is not None and hybrid.offsets is not None:  # logical there: made physical
        seq_lens = seq_lens - hybrid.offsets.numpy()
    table = batch.block_table[full_group(runner)]
    return [
        ScoredRequest(
            request_id=request_id,
            query_start=int(starts[row]),
            query_len=int(starts[row + 1] - starts[row]),
            seq_len=int(seq_lens[row]),
            block_ids=table.block_table.np[row, : table.num_blocks_per_row[row]].copy(),
        )
        for row, request_id in enumerate(batch.req_ids[:num_reqs])
    ]


def _is_runner_output(output: Any) -> bool:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    return isinstance(output, ModelRunnerOutput) and output is not EMPTY_MODEL_RUNNER_OUTPUT


def _attach_scores(state: VTokenWorker, output: Any) -> None:
    scores = state.take_scores()
    if scores is not None:
        setattr(output, SCORES_ATTRIBUTE, scores)


def sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """``sample_tokens``: the scores queued after the forward are taken once vLLM has
    queued the sampling and read the sampled tokens back, so the host never waits for
    the scores before sampling (``VTokenWorker.take_scores``)."""

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        state = getattr(self, "vtoken", None)
        if state is not None and _is_runner_output(output):
            _attach_scores(state, output)
        return output

    return sample_tokens


def prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner._prepare_inputs`` (vLLM 0.32, the V1 runner on CPU and CUDA):
    after the original derived everything from the logical ``num_computed_tokens``, turn
    what attention reads into physical counts (logical minus the request's evicted
    tokens, ``VTokenWorker.physical_offsets``). Every buffer the original fills that
    carries a sequence length or a slot, and what happens to it here:

    - ``seq_lens`` (device tensor, int32): attention metadata's ``seq_lens`` for every
      backend (FlashAttention and Triton ``seqused_k``, FlashInfer's TRT-LLM paths,
      ``CommonAttentionMetadata.compute_num_computed_tokens``): made physical on its
      device.
    - ``optimistic_seq_lens_cpu`` (host tensor, int32): read later by
      ``_build_attention_metadata`` for ``max_seq_len`` and ``seq_lens_cpu_upper_bound``,
      which FlashInfer's ``plan`` turns into page counts and kv lengths on the host: made
      physical here, after the original used its logical values for
      ``discard_request_mask`` (what to sample), which must stay logical.
    - ``block_table.slot_mapping.gpu`` (per KV group; only the device copy is filled, by
      vLLM's compute-slot-mapping kernel from ``positions`` and ``block_table.gpu``):
      recomputed into the same buffer from physical positions, before
      ``_get_slot_mappings`` slices it for the KV write and the metadata.
    - ``positions`` (device): RoPE positions, stay logical; so do ``input_ids`` (read by
      logical token index), ``num_computed_tokens`` (device copy of the host counts, read
      only inside the original) and ``num_computed_tokens_cpu`` (``is_prefilling``
      compares it with the prompt length: a phase, not a length).
    - ``block_table.block_table`` (host rows copied to the device at the start): already
      physical, the rows truncated by ``_truncate_blocks`` (rewritten by
      ``_rewrite_blocks`` in block mode) before the step.
    - ``query_start_loc``, ``req_indices``, ``query_pos``, ``num_scheduled_tokens``:
      query lengths, which eviction does not change.

    On CPU each host/device pair of a ``CpuGpuBuffer`` is one tensor and ``seq_lens``
    is a host tensor; on CUDA they are distinct, and nothing here relies on either.
    Spec decoding (``num_accepted_tokens``, drafts), async scheduling (``prev_positions``),
    decode context parallelism (``dcp_local_seq_lens``) and M-RoPE drift fill more; all
    are refused by ``check_engine``."""

    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray):
        result = original(self, scheduler_output, num_scheduled_tokens)
        state = getattr(self, "vtoken", None)
        if state is None:
            return result
        num_reqs = self.input_batch.num_reqs
        request_ids = self.input_batch.req_ids[:num_reqs]
        state.select_scored(request_ids, self.query_start_loc.np[: num_reqs + 1])
        offsets = state.physical_offsets(request_ids)
        hybrid: group_lengths.FullGroupLengths | None = getattr(self, LENGTHS, None)
        if hybrid is not None:
            hybrid.offsets = None
        if not offsets.any():
            return result
        total = scheduler_output.total_num_scheduled_tokens
        if hybrid is not None:  # the sliding groups stay logical (``group_lengths.py``)
            group_lengths.make_full_group_physical(
                self, hybrid, offsets, num_scheduled_tokens, total
            )
            return result
        per_token = np.repeat(offsets, num_scheduled_tokens).astype(np.int64)
        # Uploads from pinned memory, non_blocking: the host never waits for the device
        # here (e.g. for a fenced repack queued before).
        self.seq_lens[:num_reqs] -= to_device(offsets.astype(np.int32), self.seq_lens.device)
        self.optimistic_seq_lens_cpu[:num_reqs] -= torch.from_numpy(offsets)
        physical = self.positions[:total] - to_device(per_token, self.positions.device)
        self.input_batch.block_table.compute_slot_mapping(
            num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical
        )
        return result

    return _prepare_inputs


def attention_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """``forward(layer, query, key, value, kv_cache, attn_metadata, ...)`` of an attention
    impl (``CPUAttentionBackendImpl``; on CUDA ``CUDA_ATTENTION_IMPLS``, which vLLM 0.32
    calls alike from ``unified_attention_with_output``): after the original ran (the
    step's KV is written), a layer with a ``LayerCapture`` hands its queries to the
    worker's ``QueryCapture.record`` while the worker captures. ``attn_metadata`` is
    ``None`` in vLLM's profiling run."""

    def forward(
        self: Any,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        capture: LayerCapture | None = getattr(layer, "vtoken_capture", None)
        if capture is not None and attn_metadata is not None and capture.state.capturing:
            _record_queries(self, layer, capture, query, kv_cache, attn_metadata)
        return result

    return forward


def _record_queries(
    impl: Any,
    layer: Any,
    capture: LayerCapture,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: Any,
) -> None:
    """Record the step's queries: of the first ``num_actual_tokens`` rows (every wrapped
    backend's metadata has it; rows past it are CUDA-graph padding) as ``[num_tokens,
    num_heads, head_size]``, the worker's capture keeps those of scored requests, with the logits'
    scale. An fp8 cache is handed over as its float8 view with the layer's per-tensor
    ``_k_scale_float`` folded into the scale (the scores compute ``scale * k_scale * q .
    k``, as the backends do), the query rows as the backend forms them
    (``fp8_queries.query_conversion``)."""
    num_tokens = attn_metadata.num_actual_tokens
    query = query[:num_tokens].view(num_tokens, impl.num_heads, impl.head_size)
    scale = impl.scale
    convert = None
    if capture.key_dtype is not None:
        kv_cache = kv_cache.view(capture.key_dtype)
        scale *= layer._k_scale_float
        convert = query_conversion(layer, attn_metadata, query.dtype, capture.flashinfer_fp8_query)
    capture.state.capture.record(capture.layer_id, query, kv_cache, scale, convert)
