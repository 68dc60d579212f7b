"""A fast replica's planned macro-steps (``sim.fast_macro.plan_macro`` makes them, the
replica holds the one in flight)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.cost_model import StepCost


@dataclass(slots=True)
class MacroPlan:
    """``starts``: each planned step's start time; ``costs``: its cost; ``end_s``: when
    the last one ends. ``live`` and ``held``: per step and running request, the live
    tokens before the step and the blocks held during it (``steps x requests``)."""

    starts: list[float]
    costs: list[StepCost]
    end_s: float
    live: np.ndarray
    held: np.ndarray
    moves: np.ndarray  # per step: what its evictions leave for the next step's repack
