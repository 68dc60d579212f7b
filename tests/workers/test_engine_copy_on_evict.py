"""Prefix caching never changes what a policy keeps (copy on evict, ``workers/prefix_cache.py``).

Requests that share a prompt prefix through vLLM's prefix cache, sent in one ``generate``
call (so the later ones hit the first one's blocks in the same step), and the choices of
``n = 2`` (which share their prompt the same way), produce with caching on exactly the
tokens they produce with caching off, and evict exactly the same logical ids: a request
that evicts from a block another request also holds repacks its survivors into blocks of
its own and drops its reference, and the other holder's block stays intact.
"""

from __future__ import annotations

import pytest

from workers.engine import engine_state, make_llm

pytestmark = pytest.mark.slow

STREAMING = {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 64}}
# H2O sums every query's attention: a hit stops at its pinned prefix (whose queries read
# only pinned keys), so its shared blocks are pinned ones and nothing is copied.
H2O = {"policy": "h2o", "keep_ratio": 0.3, "prefix_pin_tokens": 64}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def text(smollm2_path):
    from transformers import AutoTokenizer

    from bench.common import natural_prompts

    (ids,) = natural_prompts(AutoTokenizer.from_pretrained(str(smollm2_path)), 1, 480)
    return ids


def _run(model: str, vtoken: dict, prompts: list[list[int]], caching: bool, n: int = 1):
    """Token ids of every choice of every prompt, in order, and each finished request's
    evicted logical ids (per step), in the order the requests were added."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(
        model,
        {**vtoken, "record_evictions": True, "check_invariants": True},
        max_model_len=1024,
        enable_prefix_caching=caching,
    )
    sampling = {"temperature": 0.8, "seed": 7} if n > 1 else {"temperature": 0}
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=n, **sampling)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    state = engine_state(llm)
    hits = [o.num_cached_tokens for o in outputs]
    tokens = [[list(c.token_ids) for c in o.outputs] for o in outputs]
    evictions = {
        request_id: [step.tolist() for step in finished.evictions]
        for request_id, finished in sorted(state.finished.items(), key=lambda kv: _order(kv[0]))
    }
    copies = state.counters.num_shared_copies
    del llm
    return tokens, list(evictions.values()), hits, copies


def _order(request_id: str) -> tuple[int, str]:
    """``LLM.generate``'s ids count up ("0-<random>", "1-<random>"; choices of ``n > 1``
    are "<index>_<parent>")."""
    head = request_id.split("-")[0]
    index, _, parent = head.partition("_")
    return (int(parent), index) if parent else (int(index), "")


def _assert_caching_changes_nothing(smollm2_path, vtoken, prompts, n=1):
    off = _run(str(smollm2_path), vtoken, prompts, caching=False, n=n)
    on = _run(str(smollm2_path), vtoken, prompts, caching=True, n=n)
    assert sum(on[2]) > 0, "no cache hit: the test shows nothing"
    if vtoken is H2O:
        assert all(hit <= 64 for hit in on[2]), "an H2O hit past its pinned prefix"
    else:
        assert on[3] > 0, "no request copied a shared block: the test shows nothing"
    assert on[1] == off[1], "caching changed what a policy evicted"
    assert on[0] == off[0], "caching changed the tokens"


def test_streaming_llm_two_prompts_sharing_a_prefix_in_one_batch(smollm2_path, text):
    _assert_caching_changes_nothing(smollm2_path, STREAMING, [text[:300], text[:411]])


@pytest.mark.parametrize("count", [2, 4])
def test_streaming_llm_and_h2o_several_requests_sharing_a_prefix(smollm2_path, text, count):
    prompts = [text[: 200 + 60 * i] for i in range(count)]
    for vtoken in (STREAMING, H2O):
        _assert_caching_changes_nothing(smollm2_path, vtoken, prompts)


@pytest.mark.parametrize("vtoken", [STREAMING, H2O], ids=["streaming_llm", "h2o"])
def test_two_choices_evict_independently(smollm2_path, text, vtoken):
    _assert_caching_changes_nothing(smollm2_path, vtoken, [text[:300]], n=2)


def test_per_head_selection_copies_a_shared_block_for_every_group(smollm2_path, text):
    """TOVA with a set per (layer, KV head): each group evicts its own tokens from the
    shared blocks, so the copy folds every group's moves (``PrefixCacheRule.copy_moves``)."""
    tova_head = {"policy": "tova", "keep_ratio": 0.5, "policy_args": {"granularity": "head"}}
    _assert_caching_changes_nothing(smollm2_path, tova_head, [text[:300], text[:411]])
