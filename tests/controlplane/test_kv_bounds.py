"""Admission's prefill peak when the engines evict during chunked prefill (``kv_bounds``
with ``prefill_chunk_tokens``) and a hybrid model's sliding-window groups (``sliding``);
the rest of ``kv_bounds`` is tested with admission (tests/controlplane/test_admission.py)."""

from __future__ import annotations

import pytest

from controlplane.kv_bounds import NO_WINDOWS, KVBounds, SlidingWindows, kv_bounds


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


# A hybrid model's sliding-window groups (window 16 tokens), blocks of 32, engines
# scheduling 64 tokens a step: each group's bound is ceil((16 - 1 + 64) / 32) + 1 = 4.
SLIDING = SlidingWindows((16,), in_flight_tokens=64, max_model_len=1024)


def test_a_sliding_group_counts_the_sequence_up_to_its_window_bound():
    assert [SLIDING.blocks(t, 32) for t in (1, 32, 33, 97, 128, 129, 1024)] == [1, 1, 2, 4, 4, 4, 4]
    two = SlidingWindows((16, 100), 64, 1024)  # ceil(163 / 32) + 1 = 7 for the second
    assert two.blocks(1024, 32) == 4 + 7 and two.blocks(40, 32) == 2 + 2
    # The context bounds it too: min(511 + 4096, 1024) tokens = 32 blocks + 1.
    assert SlidingWindows((512,), 4096, 1024).blocks(1024, 32) == 32
    # Engines' step size unknown: no cap, the sequence's blocks (never under vLLM's).
    assert SlidingWindows((16,)).blocks(1024, 32) == 32
    assert NO_WINDOWS.blocks(1024, 32) == 0
    for bad in ({"windows": (0,)}, {"in_flight_tokens": 0}, {"max_model_len": 0}):
        with pytest.raises(ValueError):
            SlidingWindows(**bad)  # type: ignore[arg-type]


def test_kv_bounds_add_the_sliding_groups_to_both_bounds_whatever_the_budget():
    """200-token prompt, 100 new tokens, a cap of 64 tokens: the full-attention group peaks
    at the prompt's 7 blocks and settles at 3; the sliding group holds min(its blocks, 4)
    at both, never evicted from."""
    plain = kv_bounds(200, 100, 32, 64)
    assert plain == KVBounds(prefill_peak=7, steady=3, window=0)
    hybrid = kv_bounds(200, 100, 32, 64, sliding=SLIDING)
    assert hybrid == KVBounds(prefill_peak=7 + 4, steady=3 + 4, window=4)
    # A short request: its window term is its own length (1 block of 32).
    assert kv_bounds(10, 6, 32, None, sliding=SLIDING) == KVBounds(2, 2, 1)
    # Chunked prefill, floors and keep ratios lower the full group's bound only.
    chunked = kv_bounds(2000, 100, 32, 64, prefill_chunk_tokens=256, sliding=SLIDING)
    assert chunked == KVBounds(prefill_peak=2 + 8 + 4, steady=3 + 4, window=4)
    squeezed = kv_bounds(200, 100, 32, None, 0.5, floor_tokens=32, sliding=SLIDING)
    assert squeezed.steady == 2 + 4
    # n choices: each holds its own window beside its own worst case.
    assert kv_bounds(200, 100, 32, 64, n=2, sliding=SLIDING) == KVBounds(2 * 11, 2 * 14, 2 * 4)
