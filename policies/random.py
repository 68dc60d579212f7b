"""Random eviction: uniform among unprotected tokens, seeded (a baseline in kvpress
"RandomPress" and in the vToken evaluation). Draws depend on (seed, step, logical id)
only, never on slot order, so paired runs with and without repack decide alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.policy import EvictionPolicy, PolicyView


@dataclass
class RandomEviction(EvictionPolicy):
    name = "random"
    seed: int = 0

    def score(self, view: PolicyView) -> np.ndarray:
        draws = np.random.default_rng([self.seed, view.step]).random(view.num_logical)
        return draws[view.logical_ids]
