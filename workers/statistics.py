"""Attention reduced to the statistics eviction policies ask for (``ScoreNeeds``).

One reduction for both engines, so a policy sees the same statistics from the reference
engine (``workers/hf_sim.py``: eager attention weights of transformers) and from vLLM
(``workers/worker_side.py``: probabilities recomputed from the captured queries over the
paged keys).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from vtoken.policy import ScoreNeeds, StepAttention


@dataclass(frozen=True, slots=True)
class ReducedAttention:
    """``reduce_attention``'s statistics as float32 tensors on the layers' device."""

    step_scores: torch.Tensor | None
    window_rows: torch.Tensor | None
    head_scores: torch.Tensor | None

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> ReducedAttention:
        """The same statistics, each passed through ``function`` (e.g. a host copy)."""
        return ReducedAttention(
            *(
                None if t is None else function(t)
                for t in (self.step_scores, self.window_rows, self.head_scores)
            )
        )

    def to_step_attention(self) -> StepAttention:
        """Host tensors as the policy reads them (numpy)."""
        return StepAttention(
            step_scores=None if self.step_scores is None else self.step_scores.numpy(),
            window_rows=None if self.window_rows is None else self.window_rows.numpy(),
            head_scores=None if self.head_scores is None else self.head_scores.numpy(),
        )


def reduce_attention(layers: Iterable[torch.Tensor], needs: ScoreNeeds) -> StepAttention:
    """``reduce_attention_tensors`` of host tensors, as the policy reads them."""
    return reduce_attention_tensors(layers, needs).map(torch.Tensor.cpu).to_step_attention()


def reduce_attention_tensors(layers: Iterable[torch.Tensor], needs: ScoreNeeds) -> ReducedAttention:
    """Reduce per-layer attention probabilities to the statistics ``needs`` asks for.

    ``layers`` yields one ``[num_q_heads, q_len, n_live]`` tensor per scored layer (each
    query row sums to 1; keys in the request's slot order). Layers are taken one at a time
    and summed in float32, so only one layer's probabilities need exist at once: a long
    prefill scored over every layer would not fit otherwise. Returns (``ScoreNeeds``):

    - ``step_scores`` ``[n_live]``: mean over heads and layers, summed over the queries;
    - ``window_rows`` ``[min(w, q_len), n_live]``: the last ``w`` query rows, same mean;
    - ``head_scores`` ``[num_layers, num_q_heads, n_live]``: summed over the window rows.

    Statistics ``needs`` does not ask for are ``None``; no layer raises ``ValueError``.
    """
    window = max(needs.query_window, 1)
    step: torch.Tensor | None = None
    window_rows: torch.Tensor | None = None
    heads = []
    num_layers = 0
    for probabilities in layers:
        probabilities = probabilities.float()
        mean = probabilities.mean(0)  # [q_len, n_live]
        step = mean.sum(0) if step is None else step + mean.sum(0)
        last = mean[-window:]
        window_rows = last if window_rows is None else window_rows + last
        if needs.per_head:
            heads.append(probabilities[:, -window:].sum(1))
        num_layers += 1
    if step is None or window_rows is None:
        raise ValueError("no attention layer to reduce")
    return ReducedAttention(
        step_scores=step / num_layers if needs.step_scores else None,
        window_rows=window_rows / num_layers if needs.query_window else None,
        head_scores=torch.stack(heads) if needs.per_head else None,
    )
