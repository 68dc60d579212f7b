"""Per-(layer, KV head) SnapKV inside vLLM against transformers, computed independently.

``test_engine_granularity.py`` compares the engine with the reference engine, which reduces
its attention through the same ``workers/statistics.py``. Here nothing of vToken's is on
the reference side: SmolLM2-135M in transformers (eager attention) gives

- the window rows: for each layer and KV head, the mean over that KV head's query heads
  (GQA: query head ``q`` reads KV head ``q // 3``) of the last 32 query rows' attention;
  they must equal the ``[w, L, Hkv, n]`` rows the policy receives from the engine;
- the decode: the engine's kept set of group ``g`` removes its evicted tokens from layer
  ``g // Hkv``, KV head ``g % Hkv`` only (an attention mask per query head); the greedy
  tokens must equal the engine's, and differ under a head-major reading of the groups.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.fragmentation import natural_prompts
from bench.quality import passkey_cases
from policies.snapkv import SnapKV
from workers.engine import engine_state, internal_request_id, make_llm

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 16
MASKED = "vtoken_group_masked"


@pytest.fixture(scope="module")
def model(smollm2_path):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.evicted = None  # [L, Hkv, k] logical ids removed per group during the decode

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if model.evicted is not None:
            evicted = torch.from_numpy(model.evicted[module.layer_idx])  # [Hkv, k]
            group = query.shape[1] // evicted.shape[0]
            mask = torch.zeros(1, query.shape[1], query.shape[2], key.shape[2])
            for q_head in range(query.shape[1]):
                mask[0, q_head, :, evicted[q_head // group]] = float("-inf")
            attention_mask = mask if attention_mask is None else attention_mask + mask
        return modeling_llama.eager_attention_forward(
            module, query, key, value, attention_mask, scaling, dropout, **kw
        )

    AttentionInterface.register(MASKED, attention)
    AttentionMaskInterface.register(MASKED, eager_mask)
    model.config._attn_implementation = MASKED
    return model


@pytest.fixture(scope="module")
def prompt(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    corpus = natural_prompts(tokenizer, 1, 4000)[0]
    return list(passkey_cases(tokenizer, corpus, 1, (600, 600), "single", 0)[0].prompt)


@pytest.fixture(scope="module")
def engine_run(smollm2_path, prompt):
    """The engine's window rows, slot order, evictions and greedy tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seen: list[tuple[np.ndarray, np.ndarray]] = []
    original = SnapKV.score

    def score(self, view):
        seen.append((view.require("window_rows").copy(), view.logical_ids.copy()))
        return original(self, view)

    config = {
        "policy": "snapkv",
        "policy_args": {"granularity": "head"},
        "keep_ratio": 0.5,
        "record_evictions": True,
    }
    # prefill in three chunks: the window rows come from the last one
    llm = make_llm(str(smollm2_path), config, max_model_len=1024, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    SnapKV.score = score  # type: ignore[method-assign]
    try:
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0]
    finally:
        SnapKV.score = original  # type: ignore[method-assign]
    state = engine_state(llm)
    evicted = [e for e in state.finished[internal_request_id(state, output.request_id)].evictions]
    yield seen, [e for e in evicted if e.size], list(output.outputs[0].token_ids)
    del llm


def test_window_rows_per_kv_head_equal_transformers(engine_run, model, prompt):
    seen, _, _ = engine_run
    assert len(seen) == 1, "SnapKV scores once, at the end of prefill"
    rows, logical_ids = seen[0]
    num_layers, num_kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    window = rows.shape[0]
    assert rows.shape == (32, num_layers, num_kv_heads, len(prompt))
    assert logical_ids.shape == (num_layers, num_kv_heads, len(prompt))
    assert (logical_ids == np.arange(len(prompt))).all()  # nothing evicted before
    model.evicted = None
    with torch.no_grad():
        attentions = model(torch.tensor([prompt]), output_attentions=True).attentions
    last = torch.stack([a[0, :, -window:, :] for a in attentions])  # [L, H, w, n]
    heads = last.shape[1]
    group_of_q = torch.arange(heads) // (heads // num_kv_heads)
    expected = torch.stack(
        [last[:, group_of_q == kv].mean(1) for kv in range(num_kv_heads)], dim=1
    ).permute(2, 0, 1, 3)  # [w, L, Hkv, n]
    np.testing.assert_allclose(rows, expected.numpy(), atol=2e-5)
    # the window rows tell the KV heads apart: a mix-up of heads could not pass
    assert (expected[:, :, 0] - expected[:, :, 1]).abs().max() > 0.1


def _greedy_with_groups_evicted(model, prompt, evicted: np.ndarray | None) -> list[int]:
    from transformers import DynamicCache

    cache, tokens = DynamicCache(), []
    model.evicted = None
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        model.evicted = evicted
        for position in range(len(prompt), len(prompt) + NUM_NEW_TOKENS):
            tokens.append(int(logits[0, -1].argmax()))
            if position == len(prompt) + NUM_NEW_TOKENS - 1:
                break
            logits = model(
                torch.tensor([[tokens[-1]]]),
                position_ids=torch.tensor([[position]]),
                past_key_values=cache,
                use_cache=True,
            ).logits
    model.evicted = None
    return tokens


def test_kept_sets_apply_to_their_layer_and_kv_head(engine_run, model, prompt):
    _, evicted, engine_tokens = engine_run
    num_layers, num_kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert len(evicted) == 1 and evicted[0].shape == (num_layers * num_kv_heads, 300)
    groups = evicted[0].reshape(num_layers, num_kv_heads, -1)  # group g: (g // Hkv, g % Hkv)
    assert _greedy_with_groups_evicted(model, prompt, groups) == engine_tokens
    head_major = evicted[0].reshape(num_kv_heads, num_layers, -1).transpose(1, 0, 2)
    assert _greedy_with_groups_evicted(model, prompt, head_major) != engine_tokens
