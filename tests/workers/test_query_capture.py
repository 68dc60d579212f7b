"""The bounded query capture: the buffer's size is the README's formula, it exists from
the model's load on (before the KV pool is sized), and it holds exactly the rows of the
scored requests that the full per-layer copy of the batch held before; fp8 queries as
FlashInfer forms them; ALiBi models refused at start."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.workers.conftest import token_prompts
from workers.engine import engine_worker, make_llm
from workers.query_capture import CaptureSize, QueryCapture
from workers.vllm_patches import UnsupportedEngineError
from workers.vllm_patches.fp8_queries import quantize_like_flashinfer, query_conversion
from workers.worker_side import VTokenWorker

CPU = torch.device("cpu")


def test_the_size_is_the_documented_formula():
    """README: scored layers x max_num_batched_tokens x query heads x head size x bytes."""
    llama_8b = CaptureSize(32, 8192, 32, 128, torch.bfloat16)
    assert llama_8b.num_bytes == 32 * 8192 * 32 * 128 * 2 == 2 * 1024**3
    small = CaptureSize(3, 40, 4, 32, torch.float32)
    capture = QueryCapture(small, [0, 2, 5], CPU)
    assert capture.queries.nbytes == small.num_bytes == 3 * 40 * 4 * 32 * 4
    with pytest.raises(ValueError, match="positive"):
        CaptureSize(0, 40, 4, 32, torch.float32)
    with pytest.raises(ValueError, match="2 scored layers"):
        QueryCapture(small, [0, 1], CPU)


def test_only_the_selected_rows_are_copied_and_too_many_are_refused():
    capture = QueryCapture(CaptureSize(2, 6, 2, 4, torch.float32), [1, 3], CPU)
    query = torch.randn(7, 2, 4)
    capture.select({"a": (1, 2), "b": (3, 0), "c": (5, 1)})
    capture.record(3, query, torch.zeros(1), 0.5)
    capture.record(2, query, torch.zeros(1), 0.5)  # not a scored layer
    assert list(capture.recorded) == [3]
    assert torch.equal(capture.recorded[3].query, query[[1, 2, 5]])
    assert capture.starts == {"a": 0, "c": 2}
    with pytest.raises(ValueError, match="7 scored rows, buffer for 6"):
        capture.select({"a": (0, 7)})


def test_flashinfer_fp8_queries_are_quantized_per_phase():
    """Decode rows to ``q_data_type_decode`` (bf16 on SM90's XQA: unchanged), prefill rows
    to fp8 by ``q_scale``, as FlashInfer's ``maybe_quant_query`` does."""
    from types import SimpleNamespace

    layer = SimpleNamespace(_q_scale_float=0.5)
    metadata = SimpleNamespace(
        q_data_type_decode=torch.bfloat16,
        q_data_type_prefill=torch.float8_e4m3fn,
        num_decode_tokens=2,
    )
    convert = query_conversion(layer, metadata, torch.bfloat16, flashinfer_fp8_query=True)
    assert convert is not None
    rows = torch.tensor([[[0.3]], [[1000.0]], [[0.3]], [[1000.0]]])
    out = convert(rows, torch.tensor([0, 1, 4, 5]))
    assert out[:2].flatten().tolist() == pytest.approx([0.3, 1000.0])
    # 0.3 / 0.5 = 0.6 -> e4m3 0.625 -> 0.3125; 2000 clamps to 448 -> 224
    assert out[2:].flatten().tolist() == [0.3125, 224.0]
    assert torch.equal(out[2:], quantize_like_flashinfer(rows[2:], 0.5, torch.float8_e4m3fn))
    assert query_conversion(layer, metadata, torch.bfloat16, flashinfer_fp8_query=False) is None


@pytest.mark.slow
def test_an_engine_captures_the_scored_rows_of_the_full_copy(tiny_llama_path, monkeypatch):
    """Two requests, one scored (H2O in its extra_args), one not: every scored layer's
    capture equals the scored request's rows of the layer's whole query (what was copied
    before), in a buffer of the formula's size allocated when the model loaded."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    steps: list[dict] = []
    select, record = VTokenWorker.select_scored, QueryCapture.record

    def select_scored(self, request_ids, query_starts):
        if self.capturing:  # a step that scores
            steps.append({"ids": list(request_ids), "starts": np.array(query_starts), "layers": {}})
        select(self, request_ids, query_starts)

    def record_rows(self, layer_id, query, kv_cache, scale, convert=None):
        record(self, layer_id, query, kv_cache, scale, convert)
        if layer_id in self.recorded and steps:
            steps[-1]["layers"][layer_id] = (query.clone(), self.recorded[layer_id].query.clone())

    monkeypatch.setattr(VTokenWorker, "select_scored", select_scored)
    monkeypatch.setattr(QueryCapture, "record", record_rows)
    max_tokens = 96
    llm = make_llm(
        tiny_llama_path,
        {"policy": "none"},
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_batched_tokens=max_tokens,
        enable_chunked_prefill=True,
    )
    runner = engine_worker(llm)
    assert runner is None  # built at the first step; the buffer exists already:
    model_runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    capture = model_runner.model_runner.vtoken_query_capture
    model_config = model_runner.model_runner.vllm_config.model_config
    config, dtype_bytes = (
        model_config.hf_config,
        torch.empty((), dtype=model_config.dtype).element_size(),
    )
    assert dtype_bytes == (4 if capture.device.type == "cpu" else 2)  # float32 / bf16
    assert capture.queries.nbytes == (
        config.num_hidden_layers
        * max_tokens
        * config.num_attention_heads
        * config.head_dim
        * dtype_bytes
    )
    h2o = {"policy": "h2o", "keep_ratio": 0.5}
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, extra_args=extra)
        for extra in ({"vtoken_policy": h2o}, {})
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in token_prompts([70, 50], seed=2)]
    llm.generate(prompts, params)
    worker = engine_worker(llm)
    assert worker is not None and worker.capture is capture
    mixed = 0
    for step in steps:
        scored = [i for i, r in enumerate(step["ids"]) if r.startswith("0-")]
        starts = step["starts"]
        expected_rows = np.concatenate(
            [np.arange(starts[i], starts[i + 1]) for i in scored] or [np.zeros(0, np.int64)]
        )
        assert sorted(step["layers"]) == [0, 1]
        for full, captured in step["layers"].values():
            assert torch.equal(captured, full[torch.from_numpy(expected_rows)])
        mixed += len(step["ids"]) == 2 and len(expected_rows) < starts[-1]
    assert mixed >= 5, "vacuous: no step had an unscored request beside the scored one"


@pytest.mark.slow
def test_an_alibi_model_is_refused_at_start(tmp_path):
    from transformers import BloomConfig, BloomForCausalLM

    folder = tmp_path / "tiny-bloom"
    torch.manual_seed(0)
    BloomForCausalLM(
        BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4)
    ).save_pretrained(folder)
    with pytest.raises(UnsupportedEngineError, match="ALiBi"):
        make_llm(str(folder), {"policy": "h2o", "keep_ratio": 0.5}, skip_tokenizer_init=True)
