"""The CUDA hooks, exercised on CPU against vLLM 0.32's own classes built without a GPU:
runner selection (``VllmConfig``), query capture in the FlashAttention and Triton
attention impls (real ``Attention`` layers and metadata; the CUDA kernels are replaced by
a stub ``original``), ``_make_worker``'s checks of a CUDA runner (real layers bound to KV
views from vLLM's ``create_kv_cache_views``) and ``_prepare_inputs`` on host and device
buffers that are distinct tensors, as on CUDA (a real ``MultiGroupBlockTable``). None of
it runs a CUDA kernel: nothing here shows the hooks work on a GPU.
"""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels import KVLayout
from vtoken.policy import ScoreNeeds
from workers import vllm_patches
from workers.config import parse_config
from workers.messages import StepOps
from workers.query_capture import CaptureSize, QueryCapture
from workers.vllm_patches import (
    CUDA_ATTENTION_IMPLS,
    LayerCapture,
    UnsupportedEngineError,
    cuda_attention_impls,
    install,
    support,
)
from workers.vllm_patches.runner_hooks import (
    _make_worker,
    attention_forward,
    initialize_kv_cache,
    prepare_inputs,
)
from workers.worker_side import VTokenWorker

VTOKEN = {"policy": "h2o", "keep_ratio": 0.5}
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 32, 16
CPU = torch.device("cpu")


# ---------------------------------------------------------------------- runner selection
@pytest.fixture
def v2_by_default(monkeypatch):
    """vLLM's own default on a CUDA machine (Triton present: V2), with the environment
    read afresh (vLLM caches it once an engine has started)."""
    import vllm.config.vllm as vllm_config_module
    from vllm import envs

    install()
    envs.disable_envs_cache()
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    support._log_v1_runner_selected.cache_clear()


def _config(vtoken: bool):
    from vllm.config import VllmConfig

    return VllmConfig(additional_config={"vtoken": VTOKEN} if vtoken else {})


def test_a_vtoken_engine_gets_the_v1_runner_when_the_variable_is_unset(v2_by_default, caplog):
    with caplog.at_level(logging.INFO, logger="workers.vllm_patches"):
        config = _config(vtoken=True)  # reads the property several times
        assert config.use_v2_model_runner is False
        plain = _config(vtoken=False)
    assert plain.use_v2_model_runner is True  # other engines: vLLM's answer
    lines = [r.message for r in caplog.records if "V1 model runner" in r.message]
    assert len(lines) == 1, lines


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False)])
def test_the_variable_decides_when_set(v2_by_default, monkeypatch, value, expected):
    config = _config(vtoken=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert config.use_v2_model_runner is expected
    assert _config(vtoken=False).use_v2_model_runner is expected


def test_a_forced_v2_runner_is_refused(v2_by_default, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    config = _config(vtoken=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(UnsupportedEngineError, match="V2 model runner .set VLLM_USE_V2"):
        vllm_patches.check_engine(config, Scheduler)


def test_hisparse_keeps_vllms_answer(v2_by_default, monkeypatch):
    config = _config(vtoken=True)
    monkeypatch.setattr(config.attention_config, "hisparse_config", object())
    assert config.use_v2_model_runner is True


# ---------------------------------------------------------------------- query capture
def _new_attention(config, backend: type, index: int):
    """A real vLLM ``Attention`` layer of ``config`` with ``backend``'s impl
    (constructible on CPU), registered in its forward context."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    with set_current_vllm_config(config):
        return Attention(
            num_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            scale=0.125,
            num_kv_heads=NUM_KV_HEADS,
            prefix=f"model.layers.{index}.self_attn.attn",
            cache_config=config.cache_config,
            attn_backend=backend,
        )


def _attention_layer(backend: type, index: int, cache_dtype: str = "auto"):
    from vllm.config import CacheConfig, VllmConfig

    config = VllmConfig(cache_config=CacheConfig(cache_dtype=cache_dtype))
    return _new_attention(config, backend, index)


def _metadata(backend_name: str, num_actual_tokens: int):
    """The backend's real metadata class; only ``num_actual_tokens`` matters here."""
    tensor = torch.zeros(2, dtype=torch.int32)
    common = dict(
        num_actual_tokens=num_actual_tokens,
        max_query_len=num_actual_tokens,
        query_start_loc=tensor,
        max_seq_len=8,
        seq_lens=tensor,
        block_table=tensor.view(1, -1),
        slot_mapping=tensor,
    )
    if backend_name == "flash_attn":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

        return FlashAttentionMetadata(**common)
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    return TritonAttentionMetadata(
        **common,
        seq_threshold_3D=0,
        num_par_softmax_segments=0,
        softmax_segm_output=tensor,
        softmax_segm_max=tensor,
        softmax_segm_expsum=tensor,
        causal=True,
    )


def _backend(backend_name: str) -> type:
    if backend_name == "flash_attn":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend


def _capture(dtype: torch.dtype = torch.float32) -> QueryCapture:
    return QueryCapture(CaptureSize(4, 16, NUM_HEADS, HEAD_SIZE, dtype), [0, 1, 2, 3], CPU)


def _capturing_worker(query_starts=(0, 1, 4), dtype=torch.float32) -> VTokenWorker:
    """A worker whose step scores request "r", the second of the batch ("a", "r"):
    batch rows ``[query_starts[1], query_starts[2])``."""
    config = parse_config({"vtoken": VTOKEN})
    assert config is not None
    state = VTokenWorker(config, KVLayout.BHNC, _capture(dtype))
    empty = np.zeros(0, dtype=np.int64)
    state.begin_step(StepOps(empty, empty, score_needs={"r": ScoreNeeds(step_scores=True)}), [])
    state.select_scored(["a", "r"], np.array(query_starts))
    return state


def _stub_forward(calls: list):
    """Stands in for the CUDA kernel call of ``Impl.forward``: records its arguments."""

    def forward(impl, layer, query, key, value, kv_cache, attn_metadata, output=None, **kw):
        calls.append((query, kv_cache, attn_metadata))
        return output

    return forward


@pytest.mark.parametrize("backend_name", ["flash_attn", "triton_attn"])
def test_capture_records_the_real_rows_heads_and_scale(backend_name):
    layer = _attention_layer(_backend(backend_name), index=3)
    impl = layer.impl
    assert f"{type(impl).__module__}.{type(impl).__qualname__}" in CUDA_ATTENTION_IMPLS
    state = _capturing_worker(query_starts=(0, 1, 3))
    layer.vtoken_capture = LayerCapture(state, 3)
    # Attention.forward hands the impl [padded tokens, heads, head_size]: 3 real, 2 padding;
    # row 0 is request "a" (not scored), rows 1 and 2 request "r".
    query = torch.randn(5, NUM_HEADS, HEAD_SIZE)
    kv_cache = torch.zeros(6, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    output = torch.zeros(5, NUM_HEADS, HEAD_SIZE)
    calls: list = []
    metadata = _metadata(backend_name, num_actual_tokens=3)
    forward = attention_forward(_stub_forward(calls))
    result = forward(impl, layer, query, query, query, kv_cache, metadata, output=output)
    assert result is output and len(calls) == 1
    captured = state.captured[3]
    assert torch.equal(captured.query, query[1:3])
    assert captured.query.shape == (2, impl.num_heads, impl.head_size)
    assert captured.query.data_ptr() == state.capture.queries[3].data_ptr()  # no new buffer
    assert captured.kv_cache is kv_cache and captured.scale == impl.scale == 0.125


def test_capture_reads_an_fp8_cache_with_its_scales():
    """fp8: keys through the float8 view, ``k_scale`` folded into the scale, a query the
    layer quantized to fp8 dequantized by ``q_scale`` (the values vLLM's KV-cache quant
    method leaves in ``_k_scale_float`` / ``_q_scale_float``)."""
    layer = _attention_layer(_backend("triton_attn"), index=1, cache_dtype="fp8")
    layer._k_scale_float, layer._q_scale_float = 0.5, 0.25
    state = _capturing_worker(query_starts=(0, 0, 2))
    layer.vtoken_capture = LayerCapture(state, 1, torch.float8_e4m3fn)
    query = torch.randn(4, NUM_HEADS, HEAD_SIZE).to(torch.float8_e4m3fn)
    kv_cache = torch.zeros(6, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.uint8)
    forward = attention_forward(_stub_forward([]))
    forward(layer.impl, layer, query, None, None, kv_cache, _metadata("triton_attn", 2))
    captured = state.captured[1]
    assert captured.kv_cache.dtype == torch.float8_e4m3fn
    assert captured.kv_cache.data_ptr() == kv_cache.data_ptr()
    assert captured.scale == pytest.approx(0.125 * 0.5)
    assert torch.equal(captured.query, query[:2].float() * 0.25)


def test_no_capture_in_the_profiling_run_or_while_no_policy_scores():
    layer = _attention_layer(_backend("flash_attn"), index=0)
    state = _capturing_worker()
    layer.vtoken_capture = LayerCapture(state, 0)
    query = torch.randn(2, NUM_HEADS, HEAD_SIZE)
    forward = attention_forward(_stub_forward([]))
    forward(layer.impl, layer, query, None, None, torch.zeros(1), None)
    assert not state.captured
    state.score_needs.clear()
    forward(layer.impl, layer, query, None, None, torch.zeros(1), _metadata("flash_attn", 2))
    assert not state.captured


def _installed_source(module: str) -> ast.Module:
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return ast.parse(Path(spec.origin).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return node


def test_flashinfer_impl_matches_the_capture_by_its_source():
    """FlashInfer's module does not import on the CPU build (no ``flashinfer`` package),
    so its class is checked in the installed source: the ``forward`` arguments the
    wrapper takes positionally, the metadata's ``num_actual_tokens``, and the impl
    attributes the capture and ``_make_worker`` read."""
    tree = _installed_source("vllm.v1.attention.backends.flashinfer")
    impl = _class(tree, "FlashInferImpl")
    (forward,) = [n for n in impl.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    names = [arg.arg for arg in forward.args.args[:7]]
    assert names == ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata"]
    fields = {
        n.target.id
        for n in _class(tree, "FlashInferMetadata").body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert {"num_actual_tokens", "q_data_type_decode", "q_data_type_prefill"} <= fields
    assert "num_decode_tokens" in fields  # decode rows first: fp8_queries.query_conversion
    # Over an fp8 cache it quantizes queries itself and scales logits by q_scale * k_scale:
    source = ast.unparse(impl)
    assert "self.maybe_quant_query(" in source
    assert "self.bmm1_scale *= layer._q_scale_float * layer._k_scale_float" in source
    assigned = {
        target.attr
        for node in ast.walk(impl)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
    }
    assert {"num_heads", "head_size", "scale", "num_kv_heads", "sliding_window"} <= assigned


def test_the_wrapped_impls_share_the_forward_signature():
    expected = ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata"]
    impls = cuda_attention_impls()
    assert {cls.__name__ for cls in impls} >= {"FlashAttentionImpl", "TritonAttentionImpl"}
    for cls in impls:
        assert list(inspect.signature(cls.forward).parameters)[:7] == expected


# ---------------------------------------------------------------------- _make_worker
@pytest.fixture
def cuda_engine(tiny_llama_path, monkeypatch):
    """A CPU-built ``VllmConfig`` of the tiny model made a CUDA one (device, worker),
    opted in, with the wrapped impls' ``forward`` wrapped as ``install`` does on CUDA."""
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=tiny_llama_path,
        skip_tokenizer_init=True,
        max_model_len=512,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        async_scheduling=False,
        additional_config={"vtoken": VTOKEN},
    ).create_engine_config()
    config.device_config.device_type = "cuda"
    config.parallel_config.worker_cls = vllm_patches.SUPPORTED_WORKERS["cuda"]
    monkeypatch.setenv(vllm_patches.UNVERIFIED_CUDA_ENV, "1")
    for cls in cuda_attention_impls():
        monkeypatch.setattr(cls, "forward", cls.forward)  # restored after the test
        vllm_patches._wrap(cls, "forward", attention_forward)
    return config


def _views(dtype: torch.dtype, num_layers: int, kernel_block_size: int | None = None):
    """Per-layer KV views as vLLM 0.32 allocates them (``LBNHC``, the Hopper default)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=dtype
    )
    layout, num_blocks = KVCacheLayout["LBNHC"], 6
    strides = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=strides[0], block_stride=strides[1]
    )
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size)


def _kv_cache_config(num_layers: int):
    """One full-attention KV cache group of ``num_layers`` layers, as vLLM groups a plain
    decoder (the part of ``KVCacheConfig`` ``_make_worker`` reads)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    return KVCacheConfig(
        num_blocks=6, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def _cuda_runner(config, backend: type, cache_dtype: str = "auto", layer_views=None):
    """A V1 ``GPUModelRunner`` as ``_make_worker`` sees it after ``initialize_kv_cache``
    (its ``__init__`` needs CUDA, so only the attributes the hook reads are set)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    config.cache_config.cache_dtype = cache_dtype
    dtype = torch.uint8 if cache_dtype == "fp8" else torch.bfloat16
    caches = _views(dtype, 2)
    for i, view in enumerate(layer_views or caches):
        _new_attention(config, backend, i).bind_kv_cache(view)
    runner = object.__new__(GPUModelRunner)
    runner.vllm_config, runner.model_config = config, config.model_config
    runner.kv_cache_config = _kv_cache_config(len(caches))  # initialize_kv_cache sets it
    runner.device, runner.kv_caches, runner.is_mm_prefix_lm = torch.device("cuda"), caches, False
    runner.vtoken_query_capture = QueryCapture(  # as load_model allocates it, on the host
        CaptureSize(2, 64, NUM_HEADS, HEAD_SIZE, torch.bfloat16), [0, 1], CPU
    )
    return runner


def _layers(config) -> list:
    return list(config.compilation_config.static_forward_context.values())


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["flash_attn", "triton_attn"])
def test_make_worker_accepts_the_v1_cuda_runner(cuda_engine, backend_name):
    runner = _cuda_runner(cuda_engine, _backend(backend_name))
    state = _make_worker(runner, parse_config(cuda_engine.additional_config))
    assert state.layout is KVLayout.BHNC
    captures = [layer.vtoken_capture for layer in _layers(cuda_engine)]
    assert captures == [LayerCapture(state, 0), LayerCapture(state, 1)]


@pytest.mark.slow
def test_make_worker_reads_an_fp8_cache_as_float8(cuda_engine):
    runner = _cuda_runner(cuda_engine, _backend("triton_attn"), cache_dtype="fp8")
    state = _make_worker(runner, parse_config(cuda_engine.additional_config))
    assert {layer.vtoken_capture.key_dtype for layer in _layers(cuda_engine)} == {
        torch.float8_e4m3fn
    }
    assert state.layout is KVLayout.BHNC


@pytest.mark.slow
def test_make_worker_refuses_other_attention_impls(cuda_engine):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    runner = _cuda_runner(cuda_engine, CPUAttentionBackend)
    with pytest.raises(UnsupportedEngineError, match="attention implementation .*CPUAttention"):
        _make_worker(runner, parse_config(cuda_engine.additional_config))


@pytest.mark.slow
def test_make_worker_refuses_kernel_block_views(cuda_engine):
    """A backend that splits blocks into kernel blocks reads views the repack does not
    move and the block table does not address."""
    kernel_views = _views(torch.bfloat16, 2, kernel_block_size=BLOCK_SIZE // 2)
    runner = _cuda_runner(cuda_engine, _backend("flash_attn"), layer_views=kernel_views)
    with pytest.raises(UnsupportedEngineError, match="KV view the runner does not hold"):
        _make_worker(runner, parse_config(cuda_engine.additional_config))


@pytest.mark.slow
def test_make_worker_refuses_other_cache_dtypes_windows_and_prefix_lm(cuda_engine):
    runner = _cuda_runner(cuda_engine, _backend("flash_attn"))
    runner.vllm_config.cache_config.cache_dtype = "fp8_e5m2"
    _layers(cuda_engine)[1].impl.sliding_window = (127, 0)
    runner.is_mm_prefix_lm = True
    with pytest.raises(
        UnsupportedEngineError,
        match="sliding-window attention .model.layers.1.self_attn.attn.; kv_cache_dtype"
        " 'fp8_e5m2'.*; PrefixLM",
    ):
        _make_worker(runner, parse_config(cuda_engine.additional_config))


@pytest.mark.slow
def test_make_worker_refuses_another_runner_on_cuda(cuda_engine):
    runner = SimpleNamespace(vllm_config=cuda_engine, device=torch.device("cuda"))
    with pytest.raises(UnsupportedEngineError, match="model runner types.SimpleNamespace"):
        _make_worker(runner, parse_config(cuda_engine.additional_config))


@pytest.mark.slow
def test_make_worker_refuses_per_head_fp8_key_scales(cuda_engine):
    """The scores fold one per-tensor key scale; per-head scales (FlashAttention 3 takes
    them) would score every head with the largest."""
    runner = _cuda_runner(cuda_engine, _backend("triton_attn"), cache_dtype="fp8")
    _layers(cuda_engine)[0]._k_scale = torch.ones(NUM_KV_HEADS)
    with pytest.raises(UnsupportedEngineError, match="per-head fp8 query or key scales"):
        _make_worker(runner, parse_config(cuda_engine.additional_config))


@pytest.mark.slow
def test_the_worker_is_built_and_checked_when_the_kv_cache_is(cuda_engine):
    """On CUDA an engine the hooks do not cover is refused when its KV cache is made,
    not at its first request; the profiling pass builds nothing."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    allocated = []
    initialize = initialize_kv_cache(lambda runner, config, *a, **k: allocated.append(config))
    runner = _cuda_runner(cuda_engine, _backend("flash_attn"))
    initialize(runner, "profiling", is_profiling=True)
    assert allocated == ["profiling"] and not hasattr(runner, "vtoken")
    initialize(runner, "final")
    assert isinstance(runner.vtoken, VTokenWorker)
    assert {layer.vtoken_capture.state for layer in _layers(cuda_engine)} == {runner.vtoken}
    cuda_engine.compilation_config.static_forward_context.clear()  # layers built anew
    foreign = _cuda_runner(cuda_engine, CPUAttentionBackend)
    with pytest.raises(UnsupportedEngineError, match="attention implementation"):
        initialize(foreign, "final", False)


def test_the_attention_op_is_one_vllm_splits_piecewise_graphs_at():
    from vllm.config import CompilationConfig

    assert vllm_patches.ATTENTION_OP in CompilationConfig._attention_ops


# ---------------------------------------------------------------------- _prepare_inputs
def test_prepare_inputs_makes_every_copy_attention_reads_physical():
    """Host and device copies distinct (as on CUDA; on CPU vLLM aliases them): the hook
    must fix the device ``seq_lens``, the host ``optimistic_seq_lens_cpu`` and the
    device slot mapping, and leave the positions logical."""
    from vllm.platforms import current_platform
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    current_platform.register_triton_kernel_overrides()  # vLLM's CPU slot-mapping kernel
    cpu = torch.device("cpu")
    table = MultiGroupBlockTable(4, 32, False, cpu, block_sizes=[4], max_num_blocks=[8])
    assert table[0].slot_mapping.gpu is not table[0].slot_mapping.cpu
    table[0].add_row([5, 2, 7], 0)  # request "a": 10 logical tokens, 3 evicted
    table[0].add_row([1, 3], 1)  # request "b": nothing evicted
    state = _capturing_worker()
    state.num_evicted = {"a": 3}
    query_start_loc = CpuGpuBuffer(5, dtype=torch.int32, device=cpu, pin_memory=False)
    runner = SimpleNamespace(
        vtoken=state,
        input_batch=SimpleNamespace(num_reqs=2, req_ids=["a", "b"], block_table=table),
        query_start_loc=query_start_loc,
        seq_lens=torch.zeros(4, dtype=torch.int32),
        optimistic_seq_lens_cpu=torch.zeros(4, dtype=torch.int32),
        positions=torch.zeros(32, dtype=torch.int64),
    )
    scheduled = np.array([2, 1], dtype=np.int32)

    def original(self, scheduler_output, num_scheduled_tokens):
        """What GPUModelRunner._prepare_inputs leaves in these buffers (logical)."""
        self.input_batch.block_table.commit_block_table(2)
        self.query_start_loc.np[:3] = [0, 2, 3]
        self.query_start_loc.copy_to_gpu()
        self.optimistic_seq_lens_cpu[:2] = torch.tensor([12, 6])
        self.seq_lens[:2] = torch.tensor([12, 6])
        self.positions[:3] = torch.tensor([10, 11, 5])
        self.input_batch.block_table.compute_slot_mapping(
            2, self.query_start_loc.gpu[:3], self.positions[:3]
        )
        return "result"

    output = SimpleNamespace(total_num_scheduled_tokens=3)
    assert prepare_inputs(original)(runner, output, scheduled) == "result"
    assert runner.seq_lens[:2].tolist() == [9, 6]
    assert runner.optimistic_seq_lens_cpu[:2].tolist() == [9, 6]
    assert runner.positions[:3].tolist() == [10, 11, 5]
    # physical positions 7, 8 of "a" -> block index 1 (block 2) and 2 (block 7)
    assert table[0].slot_mapping.gpu[:3].tolist() == [2 * 4 + 3, 7 * 4 + 0, 3 * 4 + 1]
