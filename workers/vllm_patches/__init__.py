"""Every vLLM touch point of vToken, for vLLM 0.32 (private APIs: the version is pinned).

``TOUCH_POINTS`` below is the one list of what vToken changes in vLLM: each vLLM method
wrapped (or attribute added), the hook that does it, and why. ``install()`` applies it;
each wrapper does nothing but call the original unless its engine was built with
``additional_config={"vtoken": {...}}``. On another vLLM version only a guard is
installed (``support.version_guard``).

The hooks live beside this file, one concept each:

  ``support.py``          where vToken runs (``check_engine``), the refusals at engine
                          construction, V1 runner selection, CUDA graph fallback
  ``request_checks.py``   a request's ``extra_args["vtoken_policy"]``, front end and core
  ``scheduler_hooks.py``  scheduler side (engine-core process): ``Scheduler``,
                          ``KVCacheManager``
  ``fair_hooks.py``       weighted fairness between tenants in the ``Scheduler``
  ``engine_core.py``      utilities added to ``EngineCore`` (``workers/api.py``)
  ``runner_hooks.py``     worker side (every worker process): the V1 runner and the
                          attention impls' query capture
  ``kv_groups.py``        which KV cache groups vToken manages; refusals naming layer types
  ``sliding_groups.py``   a hybrid model's sliding-window groups, kept by vLLM's managers
  ``group_lengths.py``    a hybrid model's physical lengths, for its full-attention group
  ``cuda.py``             the CUDA runner checks (opt-in, unverified on a GPU)
  ``fp8_queries.py``      the query values an fp8 cache's logits use, per backend

Prefix caching: vLLM's prefix caching runs beside vToken by the rule of
``workers/scheduler_side.py`` (a block is cached or shared only while it holds what its
hash says), with whole-block hashes (``hash_block_size == block_size``).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from workers.vllm_patches import (
    engine_core,
    group_lengths,
    request_checks,
    runner_hooks,
    scheduler_hooks,
    support,
)
from workers.vllm_patches.cuda import CUDA_ATTENTION_IMPLS, cuda_attention_impls
from workers.vllm_patches.runner_hooks import LayerCapture, worker_state
from workers.vllm_patches.scheduler_hooks import scheduler_state
from workers.vllm_patches.support import (
    ATTENTION_OP,
    SUPPORTED_WORKERS,
    UNVERIFIED_CUDA_ENV,
    UnsupportedEngineError,
    UnsupportedVLLMError,
    check_engine,
    check_version,
    fall_back_to_piecewise,
    qualname,
)

__all__ = [
    "ATTENTION_OP",
    "CUDA_ATTENTION_IMPLS",
    "SUPPORTED_WORKERS",
    "TOUCH_POINTS",
    "UNVERIFIED_CUDA_ENV",
    "LayerCapture",
    "TouchPoint",
    "UnsupportedEngineError",
    "UnsupportedVLLMError",
    "check_engine",
    "check_version",
    "cuda_attention_impls",
    "fall_back_to_piecewise",
    "install",
    "scheduler_state",
    "worker_state",
]

logger = logging.getLogger(__name__)

_INSTALLED_FLAG = "_vtoken_installed"


@dataclass(frozen=True, slots=True)
class TouchPoint:
    """One attribute of a vLLM class that vToken changes.

    ``target`` is ``module.Class.attribute``. ``how`` says what ``hook`` is: ``"wrap"``,
    a function of the original method returning its replacement; ``"property"``, the
    same for a read-only property's getter; ``"add"``, a method vLLM does not have.
    A ``cuda_only`` target is wrapped only where the platform is CUDA and its module
    imports (``cuda_attention_impls``)."""

    target: str
    hook: Callable[..., Any]
    why: str
    how: Literal["wrap", "property", "add"] = "wrap"
    cuda_only: bool = False

    @property
    def class_path(self) -> str:
        return self.target.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.target.rpartition(".")[2]


_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_REFUSE = (
    "refuse an unsupported engine in the constructing process, before it builds anything;"
    " on CUDA, FULL_AND_PIECEWISE graphs become PIECEWISE"
)

# Front ends and engine core refuse before any process, model or KV cache is built; the
# scheduler checks again with the KV cache config (every way of building an engine passes
# one of these).
TOUCH_POINTS: tuple[TouchPoint, ...] = (
    # engine construction
    TouchPoint(
        "vllm.v1.engine.llm_engine.LLMEngine.__init__",
        support.refuse_unsupported_engine,
        _REFUSE,
    ),
    TouchPoint(
        "vllm.v1.engine.async_llm.AsyncLLM.__init__",
        support.refuse_unsupported_engine,
        _REFUSE,
    ),
    TouchPoint(
        "vllm.v1.engine.core.EngineCore.__init__",
        support.refuse_unsupported_engine,
        _REFUSE,
    ),
    # request admission
    TouchPoint(
        "vllm.v1.engine.input_processor.InputProcessor._validate_params",
        request_checks.validate_params,
        "a bad extra_args['vtoken_policy'] is a client error (VLLMValidationError)",
    ),
    TouchPoint(
        "vllm.v1.engine.core.EngineCore.preprocess_add_request",
        request_checks.preprocess_add_request,
        "refuse a request that skipped the front end; vLLM answers it alone with an error",
    ),
    # scheduler side (engine-core process)
    TouchPoint(
        "vllm.v1.core.sched.scheduler.Scheduler.__init__",
        scheduler_hooks.scheduler_init,
        "check the engine with its KV cache config, attach a VTokenScheduler; fair waiting"
        " queues (fair_share on)",
    ),
    TouchPoint(
        "vllm.v1.core.sched.scheduler.Scheduler.schedule",
        scheduler_hooks.schedule,
        "attach the step's StepOps to the SchedulerOutput; tenants above their share"
        " preempted first, their counters charged (fair_share on)",
    ),
    TouchPoint(
        "vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
        scheduler_hooks.update_from_output,
        "policies evict and repacks commit, before vLLM's update may finish requests",
    ),
    TouchPoint(
        "vllm.v1.core.kv_cache_manager.KVCacheManager.get_computed_blocks",
        scheduler_hooks.get_computed_blocks,
        "a cache hit stops where the request's policy needs the prompt's queries",
    ),
    TouchPoint(
        "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
        scheduler_hooks.allocate_slots,
        "physical counts drive allocation; cache hits adopted, cacheable blocks published",
    ),
    TouchPoint(
        "vllm.v1.core.kv_cache_manager.KVCacheManager.free",
        scheduler_hooks.free,
        "finish, abort and preemption free the request's token table and ballast",
    ),
    # worker side (every worker process; the V1 runner on CPU and, opt-in, CUDA)
    TouchPoint(
        f"{_RUNNER}.execute_model",
        runner_hooks.execute_model,
        "repack and truncate blocks before the forward, score after it",
    ),
    TouchPoint(
        f"{_RUNNER}._prepare_inputs",
        runner_hooks.prepare_inputs,
        "physical seq_lens and slot mapping for attention",
    ),
    TouchPoint(
        f"{_RUNNER}.sample_tokens",
        runner_hooks.sample_tokens,
        "attach the StepScores to the ModelRunnerOutput",
    ),
    TouchPoint(
        f"{_RUNNER}.load_model",
        runner_hooks.load_model,
        "refuse ALiBi models; allocate the query capture buffer before memory profiling",
    ),
    TouchPoint(
        "vllm.v1.worker.cpu_model_runner.CPUModelRunner.load_model",
        runner_hooks.load_model,
        "the same for the CPU runner (its load_model does not call the V1 runner's)",
    ),
    TouchPoint(
        f"{_RUNNER}.initialize_kv_cache",
        runner_hooks.initialize_kv_cache,
        "on CUDA, build and check the worker at start, before the engine reports ready",
    ),
    TouchPoint(
        "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder.build",
        group_lengths.build,
        "a hybrid model's full-attention group builds from physical lengths",
    ),
    TouchPoint(
        "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward",
        runner_hooks.attention_forward,
        "hand a scored layer's queries to the worker",
    ),
    *(
        TouchPoint(
            f"{impl}.forward",
            runner_hooks.attention_forward,
            "the same on CUDA (FlashInfer only where its package imports)",
            cuda_only=True,
        )
        for impl in CUDA_ATTENTION_IMPLS
    ),
    # engine configuration
    TouchPoint(
        "vllm.config.VllmConfig.use_v2_model_runner",
        support.select_v1_runner,
        "the V1 runner (the one these hooks wrap) unless V2 is asked for",
        how="property",
    ),
    TouchPoint(
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner.__init__",
        support.refuse_runner,
        "the V2 runner is not wired: refuse a vToken engine before it exists",
    ),
    # engine core utilities (added)
    TouchPoint(
        "vllm.v1.engine.core.EngineCore.vtoken_counters",
        engine_core.vtoken_counters,
        "the engine's report as plain data",
        how="add",
    ),
    TouchPoint(
        "vllm.v1.engine.core.EngineCore.vtoken_request_counters",
        engine_core.vtoken_request_counters,
        "one request's report as plain data",
        how="add",
    ),
    TouchPoint(
        "vllm.v1.engine.core.EngineCore.vtoken_set_pressure",
        engine_core.vtoken_set_pressure,
        "the controller's per-tenant pressure and allowances",
        how="add",
    ),
)


def install() -> None:
    """Apply ``TOUCH_POINTS`` (idempotent). On another vLLM version only a guard is
    installed: engines with a vtoken config fail to start, others are untouched."""
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, _INSTALLED_FLAG, False):
        return
    try:
        check_version(vllm.__version__)
    except UnsupportedVLLMError as error:
        _wrap(Scheduler, "__init__", support.version_guard(error))
        setattr(Scheduler, _INSTALLED_FLAG, True)
        logger.warning("%s vToken stays inactive.", error)
        return
    for point, cls in _resolve(TOUCH_POINTS):
        if point.how == "wrap":
            _wrap(cls, point.attribute, point.hook)
        elif point.how == "property":
            _wrap_property(cls, point.attribute, point.hook)
        else:
            setattr(cls, point.attribute, point.hook)
    setattr(Scheduler, _INSTALLED_FLAG, True)


def _resolve(points: tuple[TouchPoint, ...]) -> list[tuple[TouchPoint, type]]:
    """Each touch point with its class, imported in table order; a ``cuda_only`` one
    appears only where ``cuda_attention_impls`` (looked up once, off CUDA: none) has it."""
    resolved = []
    cuda_impls: dict[str, type] | None = None
    for point in points:
        if not point.cuda_only:
            module_name, _, class_name = point.class_path.rpartition(".")
            resolved.append((point, getattr(importlib.import_module(module_name), class_name)))
            continue
        if cuda_impls is None:
            cuda_impls = _cuda_impls()
        if point.class_path in cuda_impls:
            resolved.append((point, cuda_impls[point.class_path]))
    return resolved


def _cuda_impls() -> dict[str, type]:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return {}
    return {qualname(cls): cls for cls in cuda_attention_impls()}


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__vtoken_original__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def _wrap_property(
    cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """``_wrap`` for a read-only property: its getter is wrapped."""
    original = getattr(cls, name).fget
    getter = make(original)
    functools.update_wrapper(getter, original)
    getter.__vtoken_original__ = original  # type: ignore[attr-defined]
    setattr(cls, name, property(getter))
