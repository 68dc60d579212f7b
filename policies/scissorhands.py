"""Scissorhands: persistence of importance.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV
Cache Compression at Test Time", NeurIPS 2023. Over the queries of a history window, a
token is important at a query if its attention is >= 1 / (keys that query sees); its
importance is hits / times observed. The recent window is protected; when over budget the
``drop_fraction * budget`` least important tokens (plus the overflow) are dropped at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.policy import EvictionPolicy, PolicyView, ScoreNeeds


@dataclass
class Scissorhands(EvictionPolicy):
    name = "scissorhands"
    needs = ScoreNeeds(query_window=32)
    stat_names = ("hits", "seen")
    observes_every_step = True  # cumulative: every step's attention counts
    recent_fraction: float = 0.25
    drop_fraction: float = 0.1

    def observe(self, view: PolicyView) -> None:
        rows = view.require("window_rows")
        visible = rows > 0
        threshold = 1.0 / np.maximum(visible.sum(axis=1, keepdims=True), 1)
        view.stats["hits"] += ((rows >= threshold) & visible).sum(axis=0)
        view.stats["seen"] += visible.sum(axis=0)

    def num_to_evict(self, view: PolicyView, budget: int) -> int:
        overflow = view.num_live - budget
        return overflow + int(self.drop_fraction * budget) if overflow > 0 else 0

    def score(self, view: PolicyView) -> np.ndarray:
        return view.stats["hits"] / np.maximum(view.stats["seen"], 1.0)
