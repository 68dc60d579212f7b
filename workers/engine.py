"""Building vLLM CPU engines with (or without) vToken, and reading their vToken state.

``engine_args`` holds the engine arguments every engine of ours shares (the replica in
``serving/engine_host.py`` uses them too); ``make_llm`` adds the environment vLLM needs on
CPU and builds an in-process engine. The read helpers work when the engine core runs in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); a replica with a separate engine-core
process calls ``EngineCore.vtoken_counters`` as a utility instead (see ``workers/api.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers.scheduler_side import VTokenScheduler

if TYPE_CHECKING:
    from workers.worker_side import VTokenWorker

CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclass(frozen=True, slots=True)
class DeviceSettings:
    """What an engine of ours (and the tests' tiny model) takes from the device: on CUDA
    bf16, head_dim 128 and piecewise CUDA graphs (``enforce_eager=False``), so that
    FlashAttention and FlashInfer can run and graphs are exercised; on CPU float32,
    head_dim 32 and eager mode (vLLM's CPU build has no graphs)."""

    dtype: str
    head_dim: int  # of ``workers.models.make_tiny_llama``
    enforce_eager: bool


CPU_SETTINGS = DeviceSettings(dtype="float32", head_dim=32, enforce_eager=True)
CUDA_SETTINGS = DeviceSettings(dtype="bfloat16", head_dim=128, enforce_eager=False)


@dataclass(frozen=True, slots=True)
class EngineVariant:
    """An attention backend and KV dtype an engine is built with (``None``: vLLM's
    choice, the only one on CPU)."""

    name: str
    attention_backend: str | None = None
    kv_cache_dtype: str = "auto"


CPU_VARIANTS = (EngineVariant("cpu"),)
CUDA_VARIANTS = (
    EngineVariant("flash_attn", "FLASH_ATTN"),
    EngineVariant("flashinfer", "FLASHINFER"),
    EngineVariant("triton_attn", "TRITON_ATTN"),
    EngineVariant("flashinfer_fp8", "FLASHINFER", kv_cache_dtype="fp8"),
)


def device_type() -> str:
    """vLLM's platform here: ``"cuda"`` with vLLM's CUDA build on a GPU, ``"cpu"`` with
    its CPU build."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def device_settings(device: str | None = None) -> DeviceSettings:
    """``CUDA_SETTINGS`` on ``"cuda"`` (default: this platform), else ``CPU_SETTINGS``."""
    return CUDA_SETTINGS if (device or device_type()) == "cuda" else CPU_SETTINGS


def engine_variants(device: str | None = None) -> tuple[EngineVariant, ...]:
    """The variants the engine tests run in: FlashAttention, FlashInfer, Triton attention
    and FlashInfer over an fp8 KV cache on CUDA; vLLM's CPU attention on CPU."""
    return CUDA_VARIANTS if (device or device_type()) == "cuda" else CPU_VARIANTS


def engine_args(
    model: str,
    vtoken: dict[str, Any] | None,
    *,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_blocks: int | None,
    dtype: Any,
    enable_prefix_caching: bool = False,
    gpu_memory_utilization: float = 0.3,
    enforce_eager: bool = True,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    otlp_traces_endpoint: str | None = None,
    attention_backend: str | None = None,
) -> dict[str, Any]:
    """The vLLM engine arguments every engine of ours shares (``vllm.LLM`` and
    ``AsyncEngineArgs`` take them alike): synchronous scheduling, ``num_blocks`` fixing the
    KV pool size (``None``: from memory), and the vToken section (``None``: a plain vLLM
    engine). Environment variables are the caller's.

    The defaults are the CPU engines' and the tests': eager mode (vLLM's CPU build has
    no graphs to replay), 0.3 of the device memory, the model's KV dtype, one device.
    A GPU replica sets them from its Serve config (``ReplicaSettings``).
    ``otlp_traces_endpoint``: vLLM's own request spans go there, joined to the caller's
    trace through ``trace_headers`` (``None``: vLLM traces nothing).
    ``attention_backend``: a vLLM ``AttentionBackendEnum`` name (``None``: vLLM picks).
    Values vLLM refuses (e.g. ``gpu_memory_utilization`` outside (0, 1]) fail when vLLM
    builds its config, with vLLM's message.
    """
    return {
        "model": model,
        "dtype": dtype,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "num_gpu_blocks_override": num_blocks,
        "enable_prefix_caching": enable_prefix_caching,
        "async_scheduling": False,
        "enforce_eager": enforce_eager,
        "gpu_memory_utilization": gpu_memory_utilization,
        "kv_cache_dtype": kv_cache_dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "otlp_traces_endpoint": otlp_traces_endpoint,
        **({"attention_backend": attention_backend} if attention_backend else {}),
        "additional_config": {"vtoken": vtoken} if vtoken is not None else {},
    }


def make_llm(
    model: str,
    vtoken: dict[str, Any] | None = None,
    *,
    block_size: int = 32,
    num_blocks: int | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    dtype: Any = None,
    enable_prefix_caching: bool = False,
    tensor_parallel_size: int = 1,
    variant: EngineVariant | None = None,
    **extra_args: Any,
) -> Any:
    """An in-process ``vllm.LLM``; ``num_blocks`` fixes the KV pool size. The engine core
    runs in this process; with ``tensor_parallel_size > 1`` pass
    ``distributed_executor_backend="mp"`` (one worker process per rank). ``dtype``
    (``None``) and graph mode come from the device (``device_settings``), the attention
    backend and KV dtype from ``variant`` (``None``: the device's first variant); an
    explicit ``enforce_eager`` or ``kv_cache_dtype`` in ``extra_args`` wins."""
    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    settings = device_settings()
    variant = variant or engine_variants()[0]
    common = engine_args(
        model,
        vtoken,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        num_blocks=num_blocks,
        dtype=dtype or settings.dtype,
        enable_prefix_caching=enable_prefix_caching,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=extra_args.pop("enforce_eager", settings.enforce_eager),
        kv_cache_dtype=extra_args.pop("kv_cache_dtype", variant.kv_cache_dtype),
        attention_backend=variant.attention_backend,
    )
    return LLM(**common, max_num_batched_tokens=max_num_batched_tokens, seed=0, **extra_args)


def engine_scheduler(llm: Any) -> Any:
    """vLLM's ``Scheduler`` of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def engine_state(llm: Any) -> VTokenScheduler | None:
    """The scheduler-side vToken state of an in-process engine (``None`` when off)."""
    from workers.vllm_patches import scheduler_state

    return scheduler_state(engine_scheduler(llm))


def engine_worker(llm: Any) -> VTokenWorker | None:
    """The worker-side vToken state of an in-process, single-worker engine."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    return getattr(runner.model_runner, "vtoken", None)


def block_pool(llm: Any) -> Any:
    return engine_scheduler(llm).kv_cache_manager.block_pool


def internal_request_id(state: VTokenScheduler, request_id: str) -> str:
    """The engine-core id of ``LLM`` request ``request_id`` (vLLM appends ``-<random>``)."""
    known = [*state.manager.requests, *state.finished]
    matches = [r for r in known if r == request_id or r.startswith(f"{request_id}-")]
    if len(matches) != 1:
        raise KeyError(f"request {request_id!r}: found {matches}")
    return matches[0]
