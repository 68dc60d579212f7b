"""StreamingLLM: keep ``sinks`` attention-sink tokens and the most recent ones.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024.
Positions stay logical (RoPE was applied when the keys were written). With an explicit
``recent`` the cache holds ``sinks + recent`` tokens; otherwise the budget decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.policy import EvictionPolicy, PolicyView


@dataclass
class StreamingLLM(EvictionPolicy):
    name = "streaming_llm"
    sinks: int = 4

    @property
    def needs_budget(self) -> bool:
        return not self.recent  # an explicit window is its own limit

    def num_to_evict(self, view: PolicyView, budget: int) -> int:
        limit = max(self.sinks, view.num_pinned) + self.recent if self.recent else budget
        return max(0, view.num_live - limit)

    def score(self, view: PolicyView) -> np.ndarray:
        return view.logical_ids.astype(np.float64)  # newer = keep
