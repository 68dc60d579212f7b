"""TOVA, token omission via attention: when over budget, drop the tokens with the lowest
attention from the current (last) query, averaged over heads.

Oren et al., "Transformers are Multi-State RNNs", 2024.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.policy import EvictionPolicy, PolicyView, ScoreNeeds


@dataclass
class TOVA(EvictionPolicy):
    name = "tova"
    needs = ScoreNeeds(query_window=1)
    granularities = ("request", "layer", "head")

    def score(self, view: PolicyView) -> np.ndarray:
        return view.require("window_rows")[-1]
