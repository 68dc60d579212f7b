"""The reduction of attention to a policy's statistics, whole or from row slices."""

from __future__ import annotations

import pytest
import torch

from vtoken.policy import ScoreNeeds
from workers.statistics import AttentionSums, reduce_attention_tensors

NEEDS = [
    ScoreNeeds(step_scores=True),
    ScoreNeeds(query_window=4),  # SnapKV
    ScoreNeeds(query_window=1, per_head=True),  # PAGE
    ScoreNeeds(query_window=1, step_scores=True),  # TOVA with step scores
    ScoreNeeds(step_scores=True, query_window=40, per_head=True),  # a window past q_len
]


def _layers(num_layers: int = 3, num_heads: int = 4, q_len: int = 11, n_live: int = 19):
    torch.manual_seed(2)
    return [torch.randn(num_heads, q_len, n_live).softmax(-1) for _ in range(num_layers)]


def reference_reduction(layers: list[torch.Tensor], needs: ScoreNeeds) -> dict:
    """The ``ScoreNeeds`` definitions, written out on whole tensors."""
    stacked = torch.stack(layers)  # [layers, heads, q_len, n_live]
    window = min(max(needs.query_window, 1), stacked.shape[2])
    mean = stacked.mean(dim=(0, 1))  # [q_len, n_live]
    return {
        "step_scores": mean.sum(0) if needs.step_scores else None,
        "window_rows": mean[-window:] if needs.query_window else None,
        "head_scores": stacked[:, :, -window:].sum(2) if needs.per_head else None,
    }


def _assert_equal(got, expected: dict) -> None:
    for name, value in expected.items():
        ours = getattr(got, name)
        assert (ours is None) == (value is None), name
        if value is not None:
            torch.testing.assert_close(ours, value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("needs", NEEDS)
def test_whole_layers_reduce_to_the_definitions(needs: ScoreNeeds) -> None:
    layers = _layers()
    _assert_equal(reduce_attention_tensors(iter(layers), needs), reference_reduction(layers, needs))


@pytest.mark.parametrize("needs", NEEDS)
@pytest.mark.parametrize("rows", [1, 3, 11])
def test_slices_reduce_as_whole_layers(needs: ScoreNeeds, rows: int) -> None:
    """Slices of ``rows`` rows from ``first_row`` on (out of order, too) give the whole
    layers' statistics: the window's rows alike, the sums over rows to float32 rounding."""
    layers = _layers()
    sums = AttentionSums(needs, q_len=11)
    assert sums.first_row == (0 if needs.step_scores else 11 - min(max(needs.query_window, 1), 11))
    for probabilities in layers:
        starts = list(range(sums.first_row, 11, rows))[::-1]
        sums.add_layer((start, probabilities[:, start : start + rows]) for start in starts)
    got = sums.reduced()
    _assert_equal(got, reference_reduction(layers, needs))
    whole = reduce_attention_tensors(iter(layers), needs)
    if needs.query_window:
        assert got.window_rows is not None and torch.equal(got.window_rows, whole.window_rows)


def test_no_layer_or_no_row_is_refused() -> None:
    with pytest.raises(ValueError, match="no attention layer"):
        reduce_attention_tensors(iter([]), ScoreNeeds(step_scores=True))
    with pytest.raises(ValueError, match="no attention layer"):
        AttentionSums(ScoreNeeds(step_scores=True), q_len=3).reduced()
    with pytest.raises(ValueError, match="query row"):
        AttentionSums(ScoreNeeds(step_scores=True), q_len=0)
    sums = AttentionSums(ScoreNeeds(query_window=1, per_head=True), q_len=5)
    with pytest.raises(ValueError, match="window rows"):
        sums.add_layer([(0, _layers(1, q_len=5)[0][:, :2])])  # rows 0 and 1, not row 4


def test_a_layer_holds_one_slice_at_a_time(monkeypatch) -> None:
    """The slice budget counts one slice's logits and probabilities: the previous slice's
    probabilities must be dropped before the next slice is computed."""
    import weakref

    from kernels import row_probabilities
    from kernels.layout import KVLayout

    torch.manual_seed(0)
    layout, heads, seq_len, q_len = KVLayout.BHNC, 4, 40, 12
    cache = layout.new_cache(4, 16, 2, 32).normal_()
    query = torch.randn(q_len, heads, 32)
    computed: list[weakref.ref] = []
    alive_when_computing: list[int] = []
    softmax = torch.Tensor.softmax

    def spy(self, *args, **kwargs):
        alive_when_computing.append(sum(ref() is not None for ref in computed))
        out = softmax(self, *args, **kwargs)
        computed.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch.Tensor, "softmax", spy)
    sums = AttentionSums(ScoreNeeds(step_scores=True, query_window=4, per_head=True), q_len)
    two_rows = 8 * heads * seq_len * 2
    sums.add_layer(
        row_probabilities.probability_slices(
            query, cache, torch.arange(3), seq_len, layout, max_bytes=two_rows
        )
    )
    assert len(computed) == 6
    assert alive_when_computing == [0] * 6


def grouped_reference(layers: list[torch.Tensor], needs: ScoreNeeds, kv_heads: int) -> dict:
    """Per layer (``groups`` "layer") or per (layer, KV head): the query heads that share
    a KV head averaged, no mean over layers."""
    stacked = torch.stack(layers)  # [layers, q_heads, q_len, n_live]
    num_layers, num_heads, q_len, n = stacked.shape
    if needs.groups == "head":
        mean = stacked.view(num_layers, kv_heads, num_heads // kv_heads, q_len, n).mean(2)
        mean = mean.permute(2, 0, 1, 3)  # [q_len, layers, kv_heads, n]
    else:
        mean = stacked.mean(1).permute(1, 0, 2)  # [q_len, layers, n]
    window = min(max(needs.query_window, 1), q_len)
    return {
        "step_scores": mean.sum(0) if needs.step_scores else None,
        "window_rows": mean[-window:] if needs.query_window else None,
        "head_scores": stacked[:, :, -window:].sum(2) if needs.per_head else None,
    }


@pytest.mark.parametrize("groups", ["layer", "head"])
@pytest.mark.parametrize("needs", NEEDS)
@pytest.mark.parametrize("rows", [2, 11])
def test_grouped_statistics_keep_the_layer_and_kv_head_axes(
    groups: str, needs: ScoreNeeds, rows: int
) -> None:
    needs = ScoreNeeds(needs.step_scores, needs.query_window, needs.per_head, groups)
    layers = _layers(num_heads=6)  # 6 query heads over 2 KV heads
    sums = AttentionSums(needs, q_len=11, num_kv_heads=2)
    for probabilities in layers:
        starts = list(range(sums.first_row, 11, rows))[::-1]
        sums.add_layer((start, probabilities[:, start : start + rows]) for start in starts)
    _assert_equal(sums.reduced(), grouped_reference(layers, needs, kv_heads=2))
    with pytest.raises(ValueError, match="KV head count"):
        AttentionSums(ScoreNeeds(step_scores=True, groups="head"), q_len=3)
