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


@pytest.mark.parametrize("layout", [KVLayout.BHNC, KVLayout.CPU_ATTN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_logits", [None, 2000])
def test_batched_decode_rows_match_the_reference(
    layout: KVLayout, dtype: torch.dtype, max_logits: int | None, monkeypatch
) -> None:
    """The torch backend scores a step's decode requests (one query row each) in one padded
    batch: each request's mass equals the reference's over its own keys, whatever the
    lengths around it (block edges, a request shorter than one block, a prefill between
    them), also when the batch is split into several chunks (``max_logits``)."""
    from kernels import attention_scores as module
    from kernels import score_spans
    from kernels.attention_scores import batch_attention_scores

    batched: list[list[int]] = []
    original = module._decode_batches

    def spy(*args):
        batches = original(*args)
        batched.extend(list(b.requests) for b in batches)
        return batches

    monkeypatch.setattr(module, "_decode_batches", spy)
    if max_logits is not None:
        monkeypatch.setattr(score_spans, "MAX_LOGITS", max_logits)
    torch.manual_seed(1)
    block_size, head_dim, num_q_heads, num_kv_heads = 16, 64, 9, 3
    seq_lens = [17, 95, 5, 48, 64, 33]
    query_lens = [1, 1, 1, 4, 1, 1]  # request 3 is a prefill chunk: scored on its own
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 1
    cache = layout.new_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    cache.normal_()
    order = torch.randperm(num_blocks)
    # Unused columns of a row hold other requests' blocks (a padded table is not zeroed).
    tables = order[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).int()
    starts = [sum(query_lens[:r]) for r in range(len(seq_lens))]
    query = torch.randn(sum(query_lens), num_q_heads, head_dim).to(dtype)
    got = batch_attention_scores(
        query, cache, tables, starts, query_lens, seq_lens, layout, backend=ScoresBackend.TORCH
    )
    offset = 0
    for r, seq_len in enumerate(seq_lens):
        rows = query[starts[r] : starts[r] + query_lens[r]]
        expected = reference_attention_scores(rows, cache, tables[r], seq_len, layout)
        torch.testing.assert_close(
            got[:, offset : offset + seq_len], expected, atol=SCORE_TOLERANCE[dtype], rtol=1e-4
        )
        offset += seq_len
    assert sorted(r for chunk in batched for r in chunk) == [0, 1, 2, 4, 5]
    assert (len(batched) > 1) == (max_logits is not None)


@pytest.mark.parametrize("layout", [KVLayout.BHNC, KVLayout.CPU_ATTN])
def test_mass_summed_over_layers_matches_the_reference(layout: KVLayout) -> None:
    """``summed_attention_mass`` (what the engine reads each step) is the reference mass
    of every request summed over the layers and KV heads: decode rows batched, a prefill
    chunk on its own, each layer with its own cache, queries and scale."""
    from kernels.attention_scores import summed_attention_mass

    torch.manual_seed(2)
    block_size, head_dim, num_q_heads, num_kv_heads = 16, 64, 6, 2
    seq_lens, query_lens = [40, 7, 33, 64], [1, 3, 1, 1]
    max_blocks = 4
    tables = torch.randperm(20)[: len(seq_lens) * max_blocks].view(-1, max_blocks).int()
    starts = [sum(query_lens[:r]) for r in range(len(seq_lens))]
    layers = []
    for scale in (0.1, 0.125, 0.2):
        cache = layout.new_cache(20, block_size, num_kv_heads, head_dim, torch.float32, DEVICE)
        layers.append((torch.randn(sum(query_lens), num_q_heads, head_dim), cache.normal_(), scale))
    got = summed_attention_mass(layers, tables, starts, query_lens, seq_lens, layout)
    expected = torch.cat(
        [
            sum(
                reference_attention_scores(
                    query[starts[r] : starts[r] + query_lens[r]], cache, tables[r], seq_lens[r],
                    layout, scale=scale,
                ).sum(0)
                for query, cache, scale in layers
            )
            for r in range(len(seq_lens))
        ]
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
