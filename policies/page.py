"""PAGE, partition-aware gated eviction: a wrapper that evicts only when the prefill
attention says it is safe.

From the prefill's observation window, each scored layer's heads pick their top-k tokens;
a layer's head agreement is the mean pairwise overlap of those sets. When agreement drops
by more than ``threshold`` from the early third of the layers to the late third, the
wrapped SnapKV-style evictor runs; otherwise the full cache is kept (seed 000, "PAGE").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

from policies.snapkv import SnapKV
from vtoken.policy import EvictionPolicy, Gate, PolicyView, ScoreNeeds


def head_agreement(head_scores: np.ndarray, top_k: int) -> np.ndarray:
    """``[layers, heads, n]`` scores -> ``[layers]`` mean pairwise overlap of top-k sets."""
    top = np.argsort(-head_scores, axis=-1, kind="stable")[..., :top_k]
    pairs = list(combinations(range(head_scores.shape[1]), 2))
    if not pairs:  # one head agrees with itself
        return np.ones(head_scores.shape[0])
    overlap = [[np.intersect1d(h[a], h[b]).size for a, b in pairs] for h in top]
    return np.asarray(overlap, dtype=np.float64).mean(axis=1) / top_k


@dataclass
class PAGE(Gate):
    name = "page"
    needs = ScoreNeeds(query_window=1, per_head=True)
    inner: EvictionPolicy = field(default_factory=SnapKV)
    threshold: float = 0.1
    top_fraction: float = 0.1
    enabled: bool | None = field(default=None, init=False)  # decided at the end of prefill
    drop: float | None = field(default=None, init=False)  # the agreement drop it was decided on

    @property
    def evicts_during_prefill(self) -> bool:
        return False  # it decides at the end of prefill

    def score_needs(self) -> ScoreNeeds:
        # It decides once, at the end of prefill: nothing to compute after that.
        return ScoreNeeds() if self.enabled is not None else super().score_needs()

    def gate(self, view: PolicyView) -> bool:
        if self.enabled is None and view.prefill_done_now:
            scores = view.require("head_scores")
            agreement = head_agreement(scores, max(1, int(self.top_fraction * view.num_live)))
            third = max(1, len(agreement) // 3)
            self.drop = float(agreement[:third].mean() - agreement[-third:].mean())
            self.enabled = self.drop > self.threshold
        return bool(self.enabled)
