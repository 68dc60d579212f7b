"""H2O, the heavy-hitter oracle: keep the recent window plus the tokens with the largest
cumulative attention received.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023 (FMInference/H2O). Every step adds the attention mass each
token received (all prefill query rows, then one row per decode step); evicted scores are
dropped with their tokens. Default split: half of the budget recent, half heavy hitters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.policy import EvictionPolicy, PolicyView, ScoreNeeds


@dataclass
class H2O(EvictionPolicy):
    name = "h2o"
    needs = ScoreNeeds(step_scores=True)
    stat_names = ("h2o_score",)
    observes_every_step = True  # cumulative: every step's attention counts
    granularities = ("request", "layer", "head")
    recent_fraction: float = 0.5

    def observe(self, view: PolicyView) -> None:
        view.stats["h2o_score"] += view.require("step_scores")

    def score(self, view: PolicyView) -> np.ndarray:
        return view.stats["h2o_score"]
