"""Hybrid models (sliding-window and full-attention KV cache groups) on a vToken engine:
the tiny random Gemma 3 (``workers.models.make_tiny_gemma3``: window 16, two groups).
Policy ``none`` is bit-identical to vanilla vLLM with prefix caching off and on; the
sliding group's blocks are vLLM's, freed as the window moves, and counted."""

from __future__ import annotations

import pytest

from tests.workers.conftest import token_prompts
from workers.engine import engine_scheduler, engine_state, make_llm
from workers.models import TINY_SLIDING_WINDOW

pytestmark = pytest.mark.slow

# Prompts past the window (16) and over several blocks (32), a shared prefix for caching.
PROMPTS = token_prompts([5, 40, 97, 150]) + [token_prompts([96])[0] + [7, 8, 9]]
CHUNKED = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}
MAX_MODEL_LEN = 1024
# Sequence lengths under, at and past the sliding group's bound (ceil(79 / 32) + 1 = 4).
WINDOW_LENGTHS = (1, 5, 32, 33, 97, 128, 129, 150, 600, MAX_MODEL_LEN)


def _generate(llm, prompts, max_tokens=30):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [
        (
            o.outputs[0].token_ids,
            [{k: v.logprob for k, v in s.items()} for s in o.outputs[0].logprobs],
            o.num_cached_tokens,
        )
        for o in outputs
    ]


@pytest.fixture(scope="module", params=[False, True], ids=["no-caching", "caching"])
def outputs(request, tiny_gemma3_path):
    caching = request.param
    results: dict = {"caching": caching}
    for name, vtoken in (("vanilla", None), ("none", {"policy": "none"})):
        llm = make_llm(
            tiny_gemma3_path,
            vtoken,
            skip_tokenizer_init=True,
            num_blocks=96,
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=caching,
            **CHUNKED,
        )
        scheduler = engine_scheduler(llm)
        groups = scheduler.kv_cache_config.kv_cache_groups
        assert len(groups) == 2
        state = engine_state(llm)
        assert (state is None) == (vtoken is None)
        if state is not None:  # what admission counts, from the engine's own bounds
            results["layout"] = state.sliding.layout
            results["bounds"] = {t: state.blocks_needed_for(t) for t in WINDOW_LENGTHS}
        # Twice: the second round hits the prefix cache (caching on).
        results[name] = [_generate(llm, PROMPTS), _generate(llm, PROMPTS)]
        if state is not None:
            state.check_invariants()
            assert state.pool.num_blocks_elsewhere == 0  # all finished: nothing held
        del llm
    return results


def test_policy_none_is_bit_identical_to_vanilla_on_a_hybrid_model(outputs):
    """Tokens, logprobs and prefix-cache hits (vLLM's hybrid rule: every group hits the
    same length) equal; with caching on, the second round hits."""
    assert outputs["none"] == outputs["vanilla"]
    cached = [hit for _, _, hit in outputs["none"][1]]
    if outputs["caching"]:
        assert sum(cached) >= 32 * len(PROMPTS[1:]), cached
    else:
        assert not any(cached)


def test_admission_counts_a_request_as_the_engine_does(outputs, tiny_gemma3_path):
    """The ingress reads the sliding windows from the model's config
    (``workers.model_windows``) as the engine's layout has them, and counts a fresh
    request of every length at the engine's own admission bound: its full-attention
    blocks plus each sliding group's window bound (vLLM's ``apply_admission_cap``)."""
    from controlplane.kv_bounds import SlidingWindows, kv_bounds
    from workers.model_windows import sliding_windows

    layout = outputs["layout"]
    windows = sliding_windows(tiny_gemma3_path)
    assert windows == layout.windows == (TINY_SLIDING_WINDOW,)
    sliding = SlidingWindows(windows, CHUNKED["max_num_batched_tokens"], MAX_MODEL_LEN)
    for length, engine_bound in outputs["bounds"].items():
        # A request of ``length`` tokens without a budget: its prompt, then its whole length.
        bounds = kv_bounds(length, 0, 32, None, sliding=sliding)
        assert bounds.prefill_peak == bounds.steady == engine_bound, length
        if length > 1:  # a one-token prompt generating the rest: its steady bound
            assert kv_bounds(1, length - 1, 32, None, sliding=sliding).steady == engine_bound
    assert outputs["bounds"][MAX_MODEL_LEN] == 32 + 4  # the window's bound, not 32 more


def test_hybrid_accounting_counts_every_group(tiny_gemma3_path):
    """StreamingLLM (sinks 4, recent 28) and policy ``none`` side by side on a pool too
    small for all of them at once, one abort: after every step the full-attention group
    holds ``ceil(live / 32)`` blocks per evicting request, the sliding group (once
    decoding) at most the two blocks a 16-token window spans, reports count both, the
    invariants (config ``check_invariants``: held + sliding + free == total) hold, and
    every block returns."""
    import math

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.engine import block_pool

    config = {"policy": "none", "check_invariants": True}
    llm = make_llm(
        tiny_gemma3_path, config, skip_tokenizer_init=True, num_blocks=24, max_model_len=320
    )
    engine, state, pool = llm.llm_engine, engine_state(llm), block_pool(llm)
    free_at_start = pool.get_num_free_blocks()
    streaming = {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 28}}
    for index, ids in enumerate(token_prompts([40 + 20 * i for i in range(8)], seed=5)):
        extra = {"vtoken_policy": streaming} if index % 2 else {}
        params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, extra_args=extra)
        engine.add_request(f"h{index}", TokensPrompt(prompt_token_ids=ids), params)
    step, window_seen = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == 7:
            engine.abort_request(["h2"])
        report = state.snapshot()
        for request in report.requests:
            kv = state.requests[request.request_id].kv
            if kv.table.num_logical > kv.prompt_len + 1:  # decoding: the window has moved
                assert request.window_blocks <= 2
            window_seen = max(window_seen, request.window_blocks)
            if request.policy == "streaming_llm":
                assert request.allocated_blocks == math.ceil(request.live_tokens / 32)
        total = report.total
        assert total.held_blocks_all_groups == total.allocated_blocks + total.window_blocks
        assert total.held_blocks_all_groups + report.free_blocks == report.total_blocks
    assert window_seen >= 2
    assert state.manager.num_evicted_tokens > 0
    assert pool.get_num_free_blocks() == free_at_start
    del llm


def test_hybrid_prefix_caching_never_changes_what_a_policy_keeps(tiny_gemma3_path):
    """StreamingLLM with prefix caching on equals it off (prompts sharing a 96-token
    prefix, twice; the first 64 tokens pinned, so published and hit), invariants checked
    every step: the full group publishes only blocks that hold what their hash says, the
    sliding groups hit by vLLM's rule."""
    config = {
        "policy": "streaming_llm",
        "policy_args": {"sinks": 4, "recent": 40},
        "prefix_pin_tokens": 64,  # kept, so published: the second round hits
        "check_invariants": True,
    }
    runs = {}
    for caching in (False, True):
        llm = make_llm(
            tiny_gemma3_path,
            config,
            skip_tokenizer_init=True,
            num_blocks=96,
            max_model_len=1024,
            enable_prefix_caching=caching,
        )
        runs[caching] = [_generate(llm, PROMPTS), _generate(llm, PROMPTS)]
        assert engine_state(llm).manager.num_evicted_tokens > 0
        del llm
    tokens = {c: [[t for t, _, _ in r] for r in rounds] for c, rounds in runs.items()}
    assert tokens[True] == tokens[False]
    # vLLM's hybrid rule: a hit needs the sliding group's window blocks still cached too
    # (the pool reuses freed ones first come), so fewer than the pinned blocks may hit.
    assert sum(hit for _, _, hit in runs[True][1]) > 0


def test_a_sliding_block_requests_share_is_charged_once(tiny_gemma3_path):
    """Prefix caching on: a request whose prompt repeats a running one's hits its blocks,
    in the sliding group too (the window at the hit's end), so both hold one sliding
    block. Reports charge it once, to the first holder: every step the requests' blocks
    in every group plus the free ones make the pool, as the control plane requires
    (``EngineCounters``: the tenants' blocks never above the used ones)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from serving.engine_translators import counters_from_snapshot

    llm = make_llm(
        tiny_gemma3_path,
        {"policy": "none", "check_invariants": True},
        skip_tokenizer_init=True,
        num_blocks=48,
        max_model_len=320,
        enable_prefix_caching=True,
    )
    engine, state = llm.llm_engine, engine_state(llm)
    prompt = token_prompts([100], seed=3)[0]  # block 2 (64-95) full within the prompt
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("first", TokensPrompt(prompt_token_ids=prompt), params)
    for _ in range(3):  # its prefill, then two tokens: its window spans blocks 2 and 3
        engine.step()
    engine.add_request("second", TokensPrompt(prompt_token_ids=prompt + [7, 8, 9]), params)
    shared_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        report = state.snapshot()
        if len(report.requests) == 2:
            ids = [state.sliding.held_block_ids(r.request_id) for r in report.requests]
            shared_seen |= bool(ids[0] & ids[1])
            assert sum(r.window_blocks for r in report.requests) == len(ids[0] | ids[1])
        total = report.total
        assert total.held_blocks_all_groups + report.free_blocks == report.total_blocks
        counters = counters_from_snapshot(report, running=len(report.requests))
        assert sum(t.blocks for t in counters.tenants.values()) == counters.used_blocks
    assert shared_seen  # the case this test is about happened
    del llm
