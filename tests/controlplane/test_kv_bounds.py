"""Admission's prefill peak when the engines evict during chunked prefill (``kv_bounds``
with ``prefill_chunk_tokens``); the rest of ``kv_bounds`` is tested with admission
(tests/controlplane/test_admission.py)."""

from __future__ import annotations

import pytest

from controlplane.kv_bounds import KVBounds, kv_bounds


def test_a_chunked_prefill_counts_one_chunk_plus_its_budget():
    # 2,000-token prompt, blocks of 16, chunks of 256 (16 blocks).
    # A cap of 64 tokens: 4 blocks kept + 16 = 20, not the prompt's 125.
    assert kv_bounds(2000, 100, 16, 64, prefill_chunk_tokens=256) == KVBounds(20, 5)
    # keep 0.2 of the prompt (400 tokens, 25 blocks) + 16; the steady bound keeps 0.2 of
    # prompt + max_tokens (420 tokens: 27 blocks, + 1).
    bounds = kv_bounds(2000, 100, 16, None, keep_ratio=0.2, prefill_chunk_tokens=256)
    assert bounds == KVBounds(prefill_peak=41, steady=28)
    assert bounds.peak == 41  # what admission reserves until the first token
    # A chunk that is not a whole number of blocks counts its blocks rounded up.
    assert kv_bounds(2000, 100, 16, 64, prefill_chunk_tokens=250).prefill_peak == 20
    assert kv_bounds(2000, 100, 16, 64, prefill_chunk_tokens=257).prefill_peak == 21


def test_the_prefill_peak_counts_what_the_policy_protects_past_its_budget():
    # kept = max(64, 100 + ceil(0.5 x 64)) = 132 tokens: 9 blocks, + 16 for the chunk
    bounds = kv_bounds(
        2000, 100, 16, 64, protected_tokens=100, protected_fraction=0.5, prefill_chunk_tokens=256
    )
    assert bounds.prefill_peak == 9 + 16
    # the same protection counted at the steady bound (+ 1 block for the step)
    assert bounds.steady == 9 + 1


def test_the_prefill_peak_is_never_above_the_prompt():
    assert kv_bounds(300, 100, 16, 64, prefill_chunk_tokens=256).prefill_peak == 19  # 300/16
    assert kv_bounds(300, 100, 16, None, 0.5, prefill_chunk_tokens=4096).prefill_peak == 19


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # no chunk known: the whole prompt
        {"keep_ratio": None},  # no budget: nothing to evict toward
        {"n": 2},  # the choices share the prompt, which none evicts while others read
    ],
    ids=["no-chunk", "no-budget", "n"],
)
def test_the_whole_prompt_counts_without_a_chunk_a_budget_or_with_several_choices(kwargs):
    chunked = {"keep_ratio": 0.2, "prefill_chunk_tokens": 256}
    if not kwargs:
        chunked.pop("prefill_chunk_tokens")
    bounds = kv_bounds(2000, 100, 16, None, **(chunked | kwargs))
    n = kwargs.get("n", 1)
    assert bounds.prefill_peak == n * 125


def test_a_bad_chunk_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        kv_bounds(2000, 100, 16, 64, prefill_chunk_tokens=0)
