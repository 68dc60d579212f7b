"""The CUDA checks: which attention implementations capture queries, and whether a CUDA
runner's layers, KV caches and cache dtype are the ones the CUDA hooks were written for.

None of this has run on a GPU (``VTOKEN_UNVERIFIED_CUDA``); ``tests/workers/
test_cuda_hooks.py`` exercises it against vLLM's own classes built on the CPU.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from kernels import KVLayout
from workers.vllm_patches.support import WHERE_VTOKEN_RUNS, UnsupportedEngineError, qualname

logger = logging.getLogger(__name__)

# The impls whose ``forward`` vLLM 0.32 calls alike from ``unified_attention_with_output``.
CUDA_ATTENTION_IMPLS = (
    "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl",
    "vllm.v1.attention.backends.flashinfer.FlashInferImpl",
    "vllm.v1.attention.backends.triton_attn.TritonAttentionImpl",
)

FLASHINFER_IMPL = CUDA_ATTENTION_IMPLS[1]

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
CUDA_CACHE_DTYPES = ("auto", "bfloat16", "float16", "half", *FP8_CACHE_DTYPES)


def cuda_attention_impls() -> list[type]:
    """The CUDA attention implementations whose ``forward`` captures queries (those of
    ``CUDA_ATTENTION_IMPLS`` whose module imports: FlashInfer's needs the ``flashinfer``
    package, absent from vLLM's CPU build)."""
    impls = []
    for dotted_name in CUDA_ATTENTION_IMPLS:
        module_name, _, class_name = dotted_name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:  # e.g. FlashInfer's package is not installed
            logger.debug("vToken: %s not wrapped (%s)", class_name, error)
            continue
        except Exception as error:  # noqa: BLE001 - a broken backend must not stop the others
            logger.warning(
                "vToken: %s not wrapped, its module fails to import (%s)", class_name, error
            )
            continue
        impls.append(getattr(module, class_name))
    return impls


def cuda_key_dtype(runner: Any, attention: dict[str, Any]) -> torch.dtype | None:
    """Check a CUDA runner against what the CUDA hooks were written for, reading it from
    the engine, and return the float8 dtype an fp8 cache's keys are read as (``None``:
    bf16/fp16). Raise ``UnsupportedEngineError`` naming every mismatch:

    - every attention layer's impl is exactly one of ``CUDA_ATTENTION_IMPLS``, its
      ``forward`` wrapped, with full attention (a sliding window counts physical slots);
    - every cache in ``runner.kv_caches`` is a ``KVLayout.BHNC`` view, bf16/fp16 or fp8
      stored as uint8 (``kv_cache_dtype`` fp8/fp8_e4m3, read as the platform's float8
      e4m3 as all three backends read it);
    - each layer reads one of those views with its impl's heads and head size (the view
      the repack moves and the block table addresses: no kernel-block remapping);
    - no PrefixLM multimodal ranges or R-SWA prefix lengths (logical positions that the
      kernels would compare with physical key indices).
    """
    cache_dtype = runner.vllm_config.cache_config.cache_dtype
    key_dtype = None
    problems = _impl_problems(attention)
    if cache_dtype in FP8_CACHE_DTYPES:
        from vllm.platforms import current_platform

        key_dtype = current_platform.fp8_dtype()
    elif cache_dtype not in CUDA_CACHE_DTYPES:
        problems.append(
            f"kv_cache_dtype {cache_dtype!r} (vToken reads bf16, fp16 and per-tensor fp8:"
            f" {', '.join(FP8_CACHE_DTYPES)})"
        )
    problems += _cache_problems(runner.kv_caches, attention, key_dtype is not None)
    if runner.is_mm_prefix_lm or runner.model_config.rswa_window is not None:
        problems.append("PrefixLM multimodal ranges or R-SWA (logical positions)")
    if problems:
        summary = "; ".join(problems)
        raise UnsupportedEngineError(
            f"vToken cannot run in this CUDA engine: {summary}. {WHERE_VTOKEN_RUNS}"
        )
    return key_dtype


def _some(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


def _wrapped_layers(attention: dict[str, Any]) -> dict[str, Any]:
    """The layers whose impl is one of ``CUDA_ATTENTION_IMPLS``."""
    return {
        name: layer
        for name, layer in attention.items()
        if qualname(type(layer.impl)) in CUDA_ATTENTION_IMPLS
    }


def _impl_problems(attention: dict[str, Any]) -> list[str]:
    problems = []
    foreign = sorted({qualname(type(layer.impl)) for layer in attention.values()})
    foreign = [name for name in foreign if name not in CUDA_ATTENTION_IMPLS]
    if foreign:
        problems.append(
            f"attention implementation {', '.join(foreign)} (vToken captures queries in"
            " FlashAttention, FlashInfer and Triton attention: pass attention_backend="
            "'FLASH_ATTN', 'FLASHINFER' or 'TRITON_ATTN')"
        )
    wrapped = _wrapped_layers(attention)
    unwrapped = [
        name
        for name, layer in wrapped.items()
        if not hasattr(type(layer.impl).forward, "__vtoken_original__")
    ]
    if unwrapped:
        problems.append(f"layers whose forward vToken did not wrap ({_some(unwrapped)})")
    windowed = [
        name for name, layer in wrapped.items() if tuple(layer.impl.sliding_window) != (-1, -1)
    ]
    if windowed:
        problems.append(f"sliding-window attention ({_some(windowed)})")
    return problems


def _cache_problems(
    kv_caches: list[torch.Tensor], attention: dict[str, Any], fp8: bool
) -> list[str]:
    problems = []
    for index, cache in enumerate(kv_caches):
        try:
            KVLayout.BHNC.check_cache(cache)
        except ValueError as error:
            problems.append(f"KV cache {index}: {error}")
    expected = (torch.uint8,) if fp8 else (torch.bfloat16, torch.float16)
    dtypes = sorted({str(cache.dtype) for cache in kv_caches if cache.dtype not in expected})
    if dtypes:
        problems.append(f"KV cache dtype {', '.join(dtypes)} (expected {expected})")
    views = {(cache.data_ptr(), cache.shape, cache.stride()) for cache in kv_caches}
    foreign, misshapen, per_head = [], [], []
    for name, layer in _wrapped_layers(attention).items():
        cache, impl = layer.kv_cache, layer.impl
        if (cache.data_ptr(), cache.shape, cache.stride()) not in views:
            foreign.append(name)
        elif (
            cache.dim() != 4
            or cache.shape[1] != impl.num_kv_heads
            or (cache.shape[3] != 2 * impl.head_size)
        ):
            misshapen.append(name)
        if fp8 and (layer._q_scale.numel() != 1 or layer._k_scale.numel() != 1):
            per_head.append(name)
    if foreign:
        problems.append(
            f"layers reading a KV view the runner does not hold ({_some(foreign)}: kernel"
            " blocks smaller than block_size? pass a block_size the backend takes whole)"
        )
    if misshapen:
        problems.append(
            f"KV views not [blocks, kv_heads, block_size, 2 * head_size] ({_some(misshapen)})"
        )
    if per_head:
        problems.append(
            f"per-head fp8 query or key scales ({_some(per_head)}: the scores fold one"
            " per-tensor scale)"
        )
    return problems
