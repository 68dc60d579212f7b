"""SnapKV: at the end of prefill, keep the prefix tokens most attended by an observation
window of the last queries, pooled so that neighbours of important tokens survive.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024, as the
official code: votes are the window's attention summed over its queries, 1-D pooled over
the tokens *before* the window only (``pooling`` "avg", the default, or "max"; odd
``kernel_size``, 5); the window itself is kept; it compresses once, then the cache grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from vtoken.policy import EvictionPolicy, PolicyView, ScoreNeeds


@dataclass
class SnapKV(EvictionPolicy):
    name = "snapkv"
    holds_budget_every_step = False  # compresses once, at the end of prefill
    granularities = ("request", "layer", "head")
    window: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    decided: bool = field(default=False, init=False, repr=False)  # it compressed already

    def __post_init__(self) -> None:
        super().__post_init__()
        odd_kernel = self.kernel_size >= 1 and self.kernel_size % 2 == 1
        if self.pooling not in ("avg", "max") or self.window < 1 or not odd_kernel:
            raise ValueError("snapkv: pooling is 'avg' or 'max', window >= 1, kernel_size odd")

    def score_needs(self) -> ScoreNeeds:
        # It decides once, at the end of prefill: no statistics are needed after that.
        needs = ScoreNeeds(query_window=self.window, groups=self.granularity)
        return ScoreNeeds() if self.decided else needs

    def num_to_evict(self, view: PolicyView, budget: int) -> int:
        if not view.prefill_done_now:
            return 0
        self.decided = True
        return max(0, view.num_live - budget)

    def protected(self, view: PolicyView, budget: int) -> np.ndarray:
        window = view.logical_ids >= view.num_logical - self.window
        return super().protected(view, budget) | window

    def score(self, view: PolicyView) -> np.ndarray:
        # Pooled over the live tokens before the window, in logical order (the window is
        # protected); decided before any eviction, so every group holds the first's ids.
        ids = view.logical_ids.reshape(-1, view.num_live)[0]
        before = np.flatnonzero(ids < view.num_logical - self.window)
        before = before[np.argsort(ids[before], kind="stable")]
        votes = view.require("window_rows").sum(axis=0)  # [..., n_live] per group
        scores = np.full(votes.shape, np.inf)
        if not before.size:  # a prompt no longer than the window: nothing to pool
            return scores
        fill = 0.0 if self.pooling == "avg" else -np.inf
        pad = np.full((*votes.shape[:-1], self.kernel_size // 2), fill)
        padded = np.concatenate([pad, votes[..., before], pad], axis=-1)
        windows = sliding_window_view(padded, self.kernel_size, axis=-1)
        scores[..., before] = windows.mean(-1) if self.pooling == "avg" else windows.max(-1)
        return scores
