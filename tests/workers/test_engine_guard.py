"""A vToken engine starts only where its hooks are wired, and refuses at construction.

The CUDA and V2 cases run against real ``VllmConfig`` objects built on the CPU with the
device (and the worker vLLM would pick there) switched to CUDA (V2 needs Triton with a
backend, which vLLM's CPU build lacks, so only that property is faked); the scheduler
class case runs end to end on the CPU engine.
"""

from __future__ import annotations

import pytest

from tests.workers.conftest import token_prompts
from workers.engine import make_llm
from workers.vllm_patches import (
    ATTENTION_OP,
    SUPPORTED_WORKERS,
    UNVERIFIED_CUDA_ENV,
    UnsupportedEngineError,
    check_engine,
    fall_back_to_piecewise,
)
from workers.vllm_patches.support import refuse_unsupported_engine

pytestmark = pytest.mark.slow

ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
VTOKEN = {"policy": "streaming_llm", "budget_tokens": 48}


def _vllm_config(model: str, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        max_model_len=512,
        block_size=32,
        enforce_eager=True,
        async_scheduling=False,
        additional_config={"vtoken": VTOKEN},
        **engine_args,
    ).create_engine_config()


def _start(model: str, scheduler_cls, vtoken=VTOKEN):
    """An in-process engine of the tiny model with the given scheduler class."""
    return make_llm(
        model, vtoken, max_model_len=512, skip_tokenizer_init=True, scheduler_cls=scheduler_cls
    )


def _scheduler():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def test_the_cpu_v1_engine_passes(tiny_llama_path):
    check_engine(_vllm_config(tiny_llama_path), _scheduler())


def _cuda_config(model: str, **engine_args):
    """A CPU-built config made a CUDA one: device and the CUDA worker vLLM would pick."""
    config = _vllm_config(model, **engine_args)
    config.device_config.device_type = "cuda"
    config.parallel_config.worker_cls = SUPPORTED_WORKERS["cuda"]
    return config


def test_cuda_device_is_refused_without_the_opt_in(tiny_llama_path, monkeypatch):
    monkeypatch.delenv(UNVERIFIED_CUDA_ENV, raising=False)
    with pytest.raises(
        UnsupportedEngineError,
        match="device 'cuda' .the CUDA hooks are wired but have never run on a GPU; set"
        " VTOKEN_UNVERIFIED_CUDA=1 to try them",
    ):
        check_engine(_cuda_config(tiny_llama_path), _scheduler())


def test_an_opted_in_cuda_engine_passes(tiny_llama_path, monkeypatch):
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    check_engine(_cuda_config(tiny_llama_path), _scheduler())


def test_piecewise_cuda_graphs_pass(tiny_llama_path, monkeypatch):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _cuda_config(tiny_llama_path)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    config.compilation_config.splitting_ops = [ATTENTION_OP]
    check_engine(config, _scheduler())


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_cuda_graphs_are_refused(tiny_llama_path, monkeypatch, mode):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _cuda_config(tiny_llama_path)
    config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    with pytest.raises(
        UnsupportedEngineError,
        match=f"cudagraph_mode {mode} .*pass compilation_config=.*PIECEWISE.* or"
        " enforce_eager=True",
    ):
        check_engine(config, _scheduler())


def _graphs(config, mode: str, splitting_ops=(ATTENTION_OP,)):
    from vllm.config import CUDAGraphMode

    config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    config.compilation_config.splitting_ops = list(splitting_ops)
    return config


def test_vllms_default_cuda_graphs_fall_back_to_piecewise_at_construction(
    tiny_llama_path, monkeypatch
):
    """``FULL_AND_PIECEWISE`` (vLLM 0.32's CUDA default) becomes ``PIECEWISE`` before the
    checks and before vLLM's own constructor sees the config."""
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _graphs(_cuda_config(tiny_llama_path), "FULL_AND_PIECEWISE")
    seen = []
    init = refuse_unsupported_engine(lambda self, c: seen.append(c.compilation_config))
    init(object(), config)
    assert [c.cudagraph_mode.name for c in seen] == ["PIECEWISE"]
    check_engine(config, _scheduler())


@pytest.mark.parametrize(
    ("device", "mode", "splitting_ops"),
    [
        ("cuda", "FULL", (ATTENTION_OP,)),  # explicit: no piecewise compilation
        ("cuda", "FULL_DECODE_ONLY", (ATTENTION_OP,)),
        ("cuda", "FULL_AND_PIECEWISE", ()),  # attention inside the piecewise graphs
        ("cuda", "PIECEWISE", (ATTENTION_OP,)),  # nothing to do
        ("cpu", "FULL_AND_PIECEWISE", (ATTENTION_OP,)),
    ],
)
def test_other_graph_modes_are_left_as_asked(
    tiny_llama_path, monkeypatch, device, mode, splitting_ops
):
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _cuda_config(tiny_llama_path) if device == "cuda" else _vllm_config(tiny_llama_path)
    _graphs(config, mode, splitting_ops)
    assert not fall_back_to_piecewise(config)
    assert config.compilation_config.cudagraph_mode.name == mode


def test_piecewise_graphs_around_attention_are_refused(tiny_llama_path, monkeypatch):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _cuda_config(tiny_llama_path)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    config.compilation_config.splitting_ops = ["vllm::mamba_mixer2"]
    with pytest.raises(UnsupportedEngineError, match="keep vllm::unified_attention_with_output"):
        check_engine(config, _scheduler())


def test_an_opted_in_cuda_engine_still_refuses_async_scheduling_and_pp(
    tiny_llama_path, monkeypatch
):
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _cuda_config(tiny_llama_path)
    config.scheduler_config.async_scheduling = True
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(UnsupportedEngineError, match="async scheduling.*pipeline parallelism"):
        check_engine(config, _scheduler())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tensor_parallelism_is_accepted(tiny_llama_path, monkeypatch, device):
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _cuda_config(tiny_llama_path) if device == "cuda" else _vllm_config(tiny_llama_path)
    config.parallel_config.tensor_parallel_size = 2
    check_engine(config, _scheduler())


def test_the_cpu_worker_is_refused_on_cuda(tiny_llama_path, monkeypatch):
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _cuda_config(tiny_llama_path)
    config.parallel_config.worker_cls = SUPPORTED_WORKERS["cpu"]
    with pytest.raises(UnsupportedEngineError, match="worker class .*CPUWorker"):
        check_engine(config, _scheduler())


def test_other_devices_are_refused(tiny_llama_path, monkeypatch):
    monkeypatch.setenv(UNVERIFIED_CUDA_ENV, "1")
    config = _vllm_config(tiny_llama_path)
    config.device_config.device_type = "xpu"
    with pytest.raises(UnsupportedEngineError, match="device 'xpu'"):
        check_engine(config, _scheduler())


def test_v2_model_runner_is_refused(tiny_llama_path, monkeypatch):
    from vllm.config import VllmConfig

    config = _vllm_config(tiny_llama_path)
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    with pytest.raises(UnsupportedEngineError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_engine(config, _scheduler())


def test_v2_runner_refuses_a_vtoken_config_before_it_exists(tiny_llama_path):
    """Defence in depth on the worker side: the V2 runner class is wrapped too."""
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

    from workers.vllm_patches import install

    install()
    runner = object.__new__(CPUModelRunnerV2)
    with pytest.raises(UnsupportedEngineError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        CPUModelRunnerV2.__init__(runner, _vllm_config(tiny_llama_path), None)
    assert not hasattr(runner, "vllm_config")  # vLLM's own __init__ never ran


def test_subclass_of_the_scheduler_is_refused(tiny_llama_path):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    with pytest.raises(UnsupportedEngineError, match="scheduler class .*AsyncScheduler"):
        check_engine(_vllm_config(tiny_llama_path), AsyncScheduler)


def test_several_problems_are_named_together(tiny_llama_path, monkeypatch):
    monkeypatch.delenv(UNVERIFIED_CUDA_ENV, raising=False)
    config = _vllm_config(tiny_llama_path)
    config.device_config.device_type = "cuda"
    config.parallel_config.worker_cls = "my.Worker"
    with pytest.raises(UnsupportedEngineError, match="device 'cuda'.*worker class my.Worker"):
        check_engine(config, _scheduler())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c, "speculative_config", object()), "speculative decoding"),
        (lambda c: setattr(c, "kv_transfer_config", object()), "KV connectors"),
        (
            lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2),
            "pipeline parallelism",
        ),
        (lambda c: setattr(c.parallel_config, "data_parallel_size", 2), "data parallelism"),
        (
            lambda c: setattr(c.parallel_config, "decode_context_parallel_size", 2),
            "decode or prefill context parallelism",
        ),
        (
            lambda c: setattr(c.parallel_config, "prefill_context_parallel_size", 2),
            "decode or prefill context parallelism",
        ),
        (
            lambda c: setattr(c.scheduler_config, "async_scheduling", True),
            "async scheduling .pass async_scheduling=False",
        ),
    ],
)
def test_unsupported_features_are_refused(tiny_llama_path, change, message):
    config = _vllm_config(tiny_llama_path)
    change(config)
    with pytest.raises(UnsupportedEngineError, match=message):
        check_engine(config, _scheduler())


def test_kv_cache_groups_vtoken_cannot_manage_are_refused_naming_layer_types(tiny_llama_path):
    """Mamba state beside full attention (a Jamba-like model): refused at start, with
    every group's layer type and layers named (the other layouts: ``test_kv_groups.py``)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    groups = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.mixer", "model.layers.2.mixer"], mamba),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full),
        ],
    )
    message = (
        r"layer types other than full and sliding-window attention .*: group 0: mamba"
        r" \(layers 0, 2\), group 1: full attention \(layers 1\)"
    )
    with pytest.raises(UnsupportedEngineError, match=message):
        check_engine(_vllm_config(tiny_llama_path), _scheduler(), groups)


def test_worker_side_refuses_a_runner_it_does_not_wrap(tiny_llama_path):
    """Defence in depth: before its first copy the worker checks its own runner class."""
    from types import SimpleNamespace

    import torch

    from workers.config import parse_config
    from workers.vllm_patches.runner_hooks import _make_worker

    config = _vllm_config(tiny_llama_path)
    runner = SimpleNamespace(vllm_config=config, device=torch.device("cpu"))
    with pytest.raises(UnsupportedEngineError, match="model runner types.SimpleNamespace"):
        _make_worker(runner, parse_config(config.additional_config))


class ForeignScheduler:
    """A scheduler class that is not vLLM's ``Scheduler`` (its wrappers never run)."""

    def __init__(self, *args, **kwargs) -> None:
        raise AssertionError("an unsupported vToken engine must be refused before this")


def test_a_scheduler_outside_vllms_class_tree_is_refused_at_construction(tiny_llama_path):
    with pytest.raises(UnsupportedEngineError, match="scheduler class .*ForeignScheduler"):
        _start(tiny_llama_path, ForeignScheduler)


def test_refusal_reaches_the_caller_with_an_engine_core_process(tiny_llama_path, monkeypatch):
    """With the engine core in its own process, ``LLM(...)`` still raises the clear error
    (not vLLM's generic "Engine core initialization failed")."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(UnsupportedEngineError, match="AsyncScheduler"):
        _start(tiny_llama_path, ASYNC_SCHEDULER)


def test_async_scheduler_engine_refuses_to_start(tiny_llama_path):
    """No request is needed: ``LLM(...)`` itself raises."""
    with pytest.raises(UnsupportedEngineError, match="AsyncScheduler.*async_scheduling=False"):
        _start(tiny_llama_path, ASYNC_SCHEDULER)


def test_async_scheduler_engine_without_vtoken_serves(tiny_llama_path):
    from vllm import SamplingParams, TokensPrompt

    from workers.engine import engine_scheduler

    llm = _start(tiny_llama_path, ASYNC_SCHEDULER, vtoken=None)
    assert type(engine_scheduler(llm)).__name__ == "AsyncScheduler"
    (prompt,) = token_prompts([40])
    (output,) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(output.outputs[0].token_ids) == 5
