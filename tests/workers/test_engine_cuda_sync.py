"""No host stall in a vToken step (CUDA only; skipped elsewhere): steps that repack, make
offsets physical and score every step run under ``torch.cuda.set_sync_debug_mode("error")``,
which raises on any PyTorch call that makes the host wait for the device (a copy from
pageable memory, ``.cpu()``, ``.item()``). vLLM's own step must pass first (the vanilla
engine, same settings): otherwise the test is skipped, not passed."""

from __future__ import annotations

import pytest
import torch

from tests.workers.conftest import token_prompts
from workers.engine import engine_state, make_llm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

H2O = {"policy": "h2o", "keep_ratio": 0.5, "record_evictions": True}


def _steps_without_sync(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy generation with every implicit host-device sync an error (after a warm-up
    generation outside the mode: first-call allocations and compilation)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs, params)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = llm.generate(inputs, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_vtoken_steps_make_the_host_wait_nowhere(tiny_llama_path, engine_variant):
    prompts = token_prompts([150, 90, 64], seed=4)
    kwargs = {"max_model_len": 512, "skip_tokenizer_init": True, "variant": engine_variant}
    vanilla = make_llm(tiny_llama_path, None, **kwargs)
    try:
        _steps_without_sync(vanilla, prompts)
    except RuntimeError as error:
        pytest.skip(f"vLLM's own step synchronises here ({error}); nothing to compare")
    finally:
        del vanilla
    llm = make_llm(tiny_llama_path, H2O, **kwargs)
    _steps_without_sync(llm, prompts)
    state = engine_state(llm)
    assert state is not None
    assert state.counters.num_scored_request_steps > 0
    assert any(step.size for record in state.finished.values() for step in record.evictions), (
        "vacuous: nothing was evicted, so nothing was repacked"
    )
