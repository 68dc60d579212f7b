"""No eviction: the full cache, bit-identical to an engine without vToken."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.policy import EvictionPolicy, PolicyView


@dataclass
class NoEviction(EvictionPolicy):
    name = "none"
    holds_budget_every_step = False
    evicts = False

    @property
    def needs_budget(self) -> bool:
        return False

    def num_to_evict(self, view: PolicyView, budget: int) -> int:
        return 0

    def score(self, view: PolicyView) -> np.ndarray:
        return np.zeros(view.num_live)
