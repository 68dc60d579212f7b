"""Probabilities in bounded row slices against the all-rows reference."""

from __future__ import annotations

import pytest
import torch

from kernels.attention_scores import attention_probabilities
from kernels.layout import KVLayout
from kernels.row_probabilities import probability_slices, rows_per_slice
from tests.kernels.conftest import DEVICE, SCORE_TOLERANCE

CASES = [  # (block_size, head_dim, num_q_heads, num_kv_heads, q_len, seq_len)
    (16, 32, 6, 2, 37, 70),  # GQA 3, a prefill chunk after 33 cached tokens
    (16, 64, 3, 3, 1, 17),  # decode, seq_len just past a block edge
    (32, 64, 8, 1, 48, 48),  # GQA 8, a whole prompt ending on a block edge
]


def _inputs(layout: KVLayout, dtype: torch.dtype, case: tuple[int, ...]):
    block_size, head_dim, num_q_heads, num_kv_heads, q_len, seq_len = case
    torch.manual_seed(1)
    num_blocks = -(-seq_len // block_size) + 2
    cache = layout.new_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    cache.normal_()
    block_table = torch.randperm(num_blocks)[: -(-seq_len // block_size)].to(DEVICE)
    query = torch.randn(q_len, num_q_heads, head_dim, device=DEVICE).to(dtype)
    return query, cache, block_table, seq_len


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 5, None])  # rows per slice; None: one slice
@pytest.mark.parametrize("first_row", [0, 30])
def test_slices_are_the_reference_rows_in_order(layout, dtype, case, rows, first_row) -> None:
    query, cache, block_table, seq_len = _inputs(layout, dtype, case)
    num_q_heads, q_len = query.shape[1], query.shape[0]
    first_row = min(first_row, q_len - 1)
    max_bytes = 1 << 40 if rows is None else 8 * num_q_heads * seq_len * rows
    expected = attention_probabilities(query, cache, block_table, seq_len, layout, scale=0.2)
    slices = list(
        probability_slices(
            query,
            cache,
            block_table,
            seq_len,
            layout,
            scale=0.2,
            first_row=first_row,
            max_bytes=max_bytes,
        )  # fmt: skip
    )
    per_slice = q_len if rows is None else rows
    assert [first for first, _ in slices] == list(range(first_row, q_len, per_slice))
    for first, probabilities in slices:
        assert probabilities.dtype == torch.float32
        assert probabilities.shape == (num_q_heads, min(per_slice, q_len - first), seq_len)
    got = torch.cat([probabilities for _, probabilities in slices], dim=1)
    torch.testing.assert_close(got, expected[:, first_row:], atol=SCORE_TOLERANCE[dtype], rtol=1e-4)


def test_default_scale_is_the_reference_default() -> None:
    query, cache, block_table, seq_len = _inputs(KVLayout.CPU_ATTN, torch.float32, CASES[0])
    expected = attention_probabilities(query, cache, block_table, seq_len, KVLayout.CPU_ATTN)
    [(_, got)] = probability_slices(query, cache, block_table, seq_len, KVLayout.CPU_ATTN)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_a_slice_stays_within_the_budget_and_holds_at_least_one_row() -> None:
    assert rows_per_slice(32, 8192, 64 << 20) == 32  # 32 rows x 32 heads x 8192 x 8 bytes
    assert 8 * 32 * 8192 * rows_per_slice(32, 8192, 64 << 20) <= 64 << 20
    assert rows_per_slice(32, 1 << 20, 64 << 20) == 1  # one row is 256 MiB: still one
    with pytest.raises(ValueError, match="positive"):
        rows_per_slice(4, 10, 0)


def test_a_first_row_outside_the_query_is_refused() -> None:
    query, cache, block_table, seq_len = _inputs(KVLayout.BHNC, torch.float32, CASES[0])
    with pytest.raises(ValueError, match="first_row"):
        next(
            probability_slices(
                query, cache, block_table, seq_len, KVLayout.BHNC, first_row=query.shape[0] + 1
            )
        )
