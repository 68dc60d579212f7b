"""Attention-score backends against the reference; the reference against its contract."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention_scores import (
    ScoresBackend,
    attention_probabilities,
    attention_scores,
    reference_attention_scores,
)
from kernels.layout import KVLayout
from tests.kernels.conftest import DEVICE, SCORE_TOLERANCE, triton_usable

CASES = [  # (block_size, head_dim, num_q_heads, num_kv_heads, q_len, seq_len)
    (16, 64, 3, 3, 1, 17),  # GQA 1, seq_len just past a block edge
    (32, 64, 9, 3, 1, 95),  # GQA 3, decode
    (16, 128, 8, 1, 5, 48),  # GQA 8, q_len > 1 ending on a block edge
    (128, 64, 6, 2, 7, 130),  # large block, seq_len crossing its edge
]


def _inputs(layout: KVLayout, dtype: torch.dtype, case: tuple[int, ...], seed: int = 0):
    block_size, head_dim, num_q_heads, num_kv_heads, q_len, seq_len = case
    torch.manual_seed(seed)
    num_blocks = -(-seq_len // block_size) + 2
    cache = layout.new_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    cache.normal_()
    block_table = torch.randperm(num_blocks)[: -(-seq_len // block_size)].int().to(DEVICE)
    query = torch.randn(q_len, num_q_heads, head_dim, device=DEVICE).to(dtype)
    return query, cache, block_table, seq_len


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_backends_match_reference(
    layout: KVLayout, dtype: torch.dtype, case: tuple[int, ...]
) -> None:
    query, cache, block_table, seq_len = _inputs(layout, dtype, case)
    expected = reference_attention_scores(query, cache, block_table, seq_len, layout)
    backends = [ScoresBackend.TORCH]
    if layout is not KVLayout.CPU_ATTN_AMX and triton_usable():
        backends.append(ScoresBackend.TRITON)
    for backend in backends:
        got = attention_scores(query, cache, block_table, seq_len, layout, backend=backend)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=SCORE_TOLERANCE[dtype], rtol=1e-4)


def test_reference_contract_by_hand() -> None:
    """One KV head, two q heads, q_len 2 over 3 keys, computed with explicit softmaxes."""
    layout = KVLayout.BHNC
    cache = layout.new_cache(2, 2, 1, 4).zero_()
    keys = torch.randn(3, 1, 4)
    layout.scatter(cache, torch.tensor([2, 3, 0]), torch.stack([keys, keys], dim=1))
    block_table = torch.tensor([1, 0])  # slots of keys 0, 1, 2: 2, 3, 0
    query = torch.randn(2, 2, 4)
    scale = 0.3
    expected = torch.zeros(3)
    for i in range(2):  # query 0 sees keys 0..1, query 1 sees 0..2
        for head in range(2):
            logits = keys[: 2 + i, 0] @ query[i, head] * scale
            expected[: 2 + i] += logits.softmax(0)
    got = reference_attention_scores(query, cache, block_table, 3, layout, scale=scale)
    torch.testing.assert_close(got[0], expected)
    got = attention_scores(
        query.to(DEVICE), cache.to(DEVICE), block_table.to(DEVICE), 3, layout, scale=scale
    )
    torch.testing.assert_close(got[0].cpu(), expected)


def test_default_scale_and_row_sums() -> None:
    case = (32, 64, 9, 3, 4, 70)
    query, cache, block_table, seq_len = _inputs(KVLayout.CPU_ATTN, torch.float32, case)
    got = attention_scores(query, cache, block_table, seq_len, KVLayout.CPU_ATTN)
    explicit = attention_scores(
        query, cache, block_table, seq_len, KVLayout.CPU_ATTN, scale=1 / math.sqrt(64)
    )
    torch.testing.assert_close(got, explicit)
    torch.testing.assert_close(got.sum(dim=1).cpu(), torch.full((3,), 4 * 9 / 3.0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_len": 3}, "q_len"),
        ({"seq_len": 200}, "cannot hold"),
        ({"query": torch.zeros(4, 8, 64)}, "multiple"),
        ({"query": torch.zeros(4, 9, 32)}, "head_dim"),
        ({"block_table": torch.zeros(3, dtype=torch.float32)}, "int32/int64"),
    ],
)
def test_bad_arguments_raise(change: dict, message: str) -> None:
    case = (32, 64, 9, 3, 4, 70)
    query, cache, block_table, seq_len = _inputs(KVLayout.CPU_ATTN, torch.float32, case)
    args = {"query": query, "block_table": block_table, "seq_len": seq_len} | change
    with pytest.raises(ValueError, match=message):
        attention_scores(
            args["query"].to(DEVICE),
            cache,
            args["block_table"].to(DEVICE),
            args["seq_len"],
            KVLayout.CPU_ATTN,
        )


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("case", CASES)
def test_probabilities_are_causal_softmaxes(layout: KVLayout, case: tuple[int, ...]) -> None:
    """Rows sum to 1, query ``i`` gives nothing to keys after ``seq_len - q_len + i``, and
    summed over queries and a KV group's heads they are the scores."""
    query, cache, block_table, seq_len = _inputs(layout, torch.float32, case)
    num_q_heads, q_len = query.shape[1], query.shape[0]
    got = attention_probabilities(query, cache, block_table, seq_len, layout, scale=0.2)
    assert got.dtype == torch.float32 and got.shape == (num_q_heads, q_len, seq_len)
    torch.testing.assert_close(got.sum(-1), torch.ones(num_q_heads, q_len, device=DEVICE))
    for i in range(q_len):
        assert not got[:, i, seq_len - q_len + i + 1 :].any()
    scores = attention_scores(query, cache, block_table, seq_len, layout, scale=0.2)
    summed = got.sum(1).view(scores.shape[0], -1, seq_len).sum(1)
    torch.testing.assert_close(summed, scores, atol=1e-5, rtol=1e-4)
