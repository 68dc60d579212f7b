"""Tensor parallelism: a vToken engine at TP=2 (two CPU workers, vLLM's multiprocess
executor and its CPU communicator) sees the same attention statistics, makes the same
eviction decisions and produces the same tokens as the same engine at TP=1.

Each rank holds half the query heads and scores them alone; without the reduction over
the ranks (``workers/tensor_parallel.py``) the scheduler would get rank 0's heads only:
other ``step_scores``/``window_rows`` and ``head_scores`` with half the heads. Three
requests cover the three statistics: H2O (per-key mass, the batched path), TOVA (the
last query row), PAGE (per-head scores of the prefill window, gathered in head order).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

from tests.workers.conftest import token_prompts
from workers.engine import engine_state, internal_request_id, make_llm

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 12
POLICIES = [
    {"policy": "h2o", "keep_ratio": 0.5},
    {"policy": "tova", "keep_ratio": 0.5},
    {"policy": "page", "keep_ratio": 0.5, "policy_args": {"threshold": -1.0}},
]


def _thread_binding() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two CPU workers: half of this process's CPUs each
    (vLLM's automatic binding wants a NUMA node per worker)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    first, second = cpus[:half], cpus[half:] or cpus[:half]
    return f"{','.join(map(str, first))}|{','.join(map(str, second))}"


def _run(model: str, tensor_parallel_size: int):
    """Tokens, evictions and every step's statistics as the scheduler received them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}
    llm = make_llm(
        model,
        {"policy": "h2o", "keep_ratio": 0.5, "record_evictions": True, "check_invariants": True},
        skip_tokenizer_init=True,
        tensor_parallel_size=tensor_parallel_size,
        **extra,
    )
    state = engine_state(llm)
    received: list[dict] = []
    after_step = state.after_step

    def recording_after_step(num_scheduled, requests, scores, **kwargs):
        if scores is not None:
            received.append(copy.deepcopy(scores.attention))
        return after_step(num_scheduled, requests, scores, **kwargs)

    state.after_step = recording_after_step
    prompts = [TokensPrompt(prompt_token_ids=p) for p in token_prompts([70, 90, 110], seed=5)]
    params = [
        SamplingParams(
            max_tokens=NUM_NEW_TOKENS,
            temperature=0,
            ignore_eos=True,
            extra_args={"vtoken_policy": policy},
        )
        for policy in POLICIES
    ]
    outputs = llm.generate(prompts, params)
    ids = {internal_request_id(state, o.request_id): o.request_id for o in outputs}
    run = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "evictions": [state.finished[i].evictions for i in ids],
        "scores": [{ids[r]: stats for r, stats in step.items()} for step in received],
    }
    del llm
    return run


@pytest.fixture(scope="module")
def runs(tiny_llama_path):
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip("TP=2 on CUDA needs two GPUs (on CPU it runs on two worker processes)")
    single = _run(tiny_llama_path, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", _thread_binding())
        # An engine core built earlier in this process caches vLLM's environment reads:
        # without this the workers would bind as the cached value says.
        import vllm.envs

        vllm.envs.disable_envs_cache()
        try:
            double = _run(tiny_llama_path, 2)
        finally:  # the TP=2 engine core cached the binding: later engines must not see it
            vllm.envs.disable_envs_cache()
    return single, double


def test_the_scheduler_sees_every_heads_statistics(runs):
    single, double = runs
    assert len(single["scores"]) == len(double["scores"]) > NUM_NEW_TOKENS // 2
    seen = set()
    for step, (one, two) in enumerate(zip(single["scores"], double["scores"], strict=True)):
        assert one.keys() == two.keys(), step
        for request_id, stats in one.items():
            other = two[request_id]
            for name in ("step_scores", "window_rows", "head_scores"):
                ours, theirs = getattr(stats, name), getattr(other, name)
                assert (ours is None) == (theirs is None), (step, request_id, name)
                if ours is not None:
                    seen.add(name)
                    assert ours.shape == theirs.shape, (step, request_id, name)
                    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-6)
    assert seen == {"step_scores", "window_rows", "head_scores"}, "a statistic never ran"


def test_decisions_and_tokens_equal_one_rank(runs):
    single, double = runs
    for one, two in zip(single["evictions"], double["evictions"], strict=True):
        assert sum(e.size for e in one) > 0, "no eviction: the test is vacuous"
        assert len(one) == len(two)
        for step, (ours, theirs) in enumerate(zip(one, two, strict=True)):
            assert np.array_equal(ours, theirs), step
    assert single["tokens"] == double["tokens"]
