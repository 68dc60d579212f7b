"""The worker's scores of requests that read query rows (windows, per-head statistics):
a real capture buffer and paged caches on CPU, the statistics as the scheduler takes them,
against the probabilities of every row at once reduced by the ``ScoreNeeds`` definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import KVLayout
from kernels.attention_scores import attention_probabilities
from kernels.row_probabilities import rows_per_slice
from vtoken.policy import ScoreNeeds
from workers.config import parse_config
from workers.messages import StepOps
from workers.query_capture import CaptureSize, QueryCapture
from workers.worker_side import ScoredRequest, VTokenWorker

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 32, 16
Q_LEN, SEQ_LEN, FIRST_ROW = 21, 53, 3  # a prefill chunk after 32 cached tokens
LAYOUT = KVLayout.BHNC
NEEDS = [
    ScoreNeeds(query_window=8),  # SnapKV
    ScoreNeeds(query_window=1, per_head=True),  # PAGE
    ScoreNeeds(query_window=1, step_scores=True),  # TOVA with step scores
    ScoreNeeds(step_scores=True, query_window=32, per_head=True),  # Scissorhands-like
]


def _step(max_slice_bytes: int | None, needs: ScoreNeeds):
    """Request "r" (batch rows ``[FIRST_ROW, FIRST_ROW + Q_LEN)``) scored over two layers."""
    torch.manual_seed(3)
    config = parse_config({"vtoken": {"policy": "h2o", "keep_ratio": 0.5}})
    assert config is not None
    capture = QueryCapture(
        CaptureSize(2, 32, NUM_HEADS, HEAD_SIZE, torch.float32), [0, 1], torch.device("cpu")
    )
    kwargs = {} if max_slice_bytes is None else {"max_slice_bytes": max_slice_bytes}
    worker = VTokenWorker(config, LAYOUT, capture, **kwargs)
    empty = np.zeros(0, dtype=np.int64)
    worker.begin_step(StepOps(empty, empty, score_needs={"r": needs}), [])
    worker.select_scored(["a", "r"], np.array([0, FIRST_ROW, FIRST_ROW + Q_LEN]))
    block_ids = np.array([5, 1, 3, 0], dtype=np.int32)
    layers = []
    for layer_id in (0, 1):
        cache = LAYOUT.new_cache(6, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE).normal_()
        batch = torch.randn(FIRST_ROW + Q_LEN, NUM_HEADS, HEAD_SIZE)
        worker.capture.record(layer_id, batch, cache, 0.3)
        layers.append((batch[FIRST_ROW:], cache))
    worker.launch_scores([ScoredRequest("r", FIRST_ROW, Q_LEN, SEQ_LEN, block_ids)])
    scores = worker.take_scores()
    assert scores is not None
    return scores.attention["r"], layers, torch.from_numpy(block_ids)


def _reference(layers, block_table, needs: ScoreNeeds) -> dict:
    stacked = torch.stack(
        [
            attention_probabilities(query, cache, block_table, SEQ_LEN, LAYOUT, scale=0.3)
            for query, cache in layers
        ]
    )  # [layers, heads, q_len, seq_len]
    window = min(max(needs.query_window, 1), Q_LEN)
    mean = stacked.mean(dim=(0, 1))
    return {
        "step_scores": mean.sum(0) if needs.step_scores else None,
        "window_rows": mean[-window:] if needs.query_window else None,
        "head_scores": stacked[:, :, -window:].sum(2) if needs.per_head else None,
    }


@pytest.mark.parametrize("needs", NEEDS)
def test_several_slices_give_one_slices_statistics(needs: ScoreNeeds) -> None:
    small = 8 * NUM_HEADS * SEQ_LEN * 2  # two rows a slice: eleven slices of the chunk
    assert rows_per_slice(NUM_HEADS, SEQ_LEN, small) == 2
    sliced, layers, block_table = _step(small, needs)
    whole, _, _ = _step(None, needs)
    expected = _reference(layers, block_table, needs)
    for name, value in expected.items():
        ours, theirs = getattr(sliced, name), getattr(whole, name)
        assert (ours is None) == (theirs is None) == (value is None), name
        if value is None:
            continue
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(ours, value.numpy(), rtol=1e-5, atol=1e-6)
    if needs.query_window:
        assert np.array_equal(sliced.window_rows, whole.window_rows)  # the same rows alike
