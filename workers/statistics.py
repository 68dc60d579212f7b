"""Attention reduced to the statistics eviction policies ask for (``ScoreNeeds``).

One reduction for both engines, so a policy sees the same statistics from the reference
engine (``workers/hf_sim.py``: eager attention weights of transformers) and from vLLM
(``workers/worker_side.py``: probabilities recomputed from the captured queries over the
paged keys).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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


def reduce_attention(
    layers: Iterable[torch.Tensor], needs: ScoreNeeds, num_kv_heads: int = 0
) -> StepAttention:
    """``reduce_attention_tensors`` of host tensors, as the policy reads them."""
    reduced = reduce_attention_tensors(layers, needs, num_kv_heads)
    return reduced.map(torch.Tensor.cpu).to_step_attention()


def reduce_attention_tensors(
    layers: Iterable[torch.Tensor], needs: ScoreNeeds, num_kv_heads: int = 0
) -> ReducedAttention:
    """Reduce per-layer attention probabilities to the statistics ``needs`` asks for.

    ``layers`` yields one ``[num_q_heads, q_len, n_live]`` tensor per scored layer (each
    query row sums to 1; keys in the request's slot order). Layers are taken one at a time
    (``AttentionSums``), so only one layer's probabilities need exist at once. Returns
    ``AttentionSums.reduced``; no layer raises ``ValueError``.
    """
    sums: AttentionSums | None = None
    for probabilities in layers:
        if sums is None:
            sums = AttentionSums(needs, probabilities.shape[1], num_kv_heads)
        sums.add_layer([(0, probabilities)])
    if sums is None:
        raise ValueError("no attention layer to reduce")
    return sums.reduced()


@dataclass(slots=True)
class AttentionSums:
    """The statistics ``needs`` asks for, summed over layers whose probabilities come in
    slices of query rows (``kernels.row_probabilities.probability_slices``) or whole.

    A step has ``q_len`` query rows; the window is its last ``w = min(max(query_window,
    1), q_len)`` rows. Only rows ``[first_row, q_len)`` are read: every row with
    ``step_scores``, else the window's (rows before it change no statistic asked for).
    ``reduced`` gives (float32, on the probabilities' device):

    - ``step_scores`` ``[n_live]``: mean over heads and layers, summed over the queries;
    - ``window_rows`` ``[w, n_live]``: the window's rows, same mean;
    - ``head_scores`` ``[num_layers, num_q_heads, n_live]``: summed over the window rows.

    ``needs.groups`` ``"layer"`` keeps the layer axis of the first two (``[L, n_live]``,
    ``[w, L, n_live]``: no mean over layers), ``"head"`` the layer and KV-head axes
    (``[L, Hkv, n_live]``, ``[w, L, Hkv, n_live]``: the mean over the ``num_kv_heads``
    groups of query heads, as GQA shares a KV head: query head ``q`` reads KV head
    ``q // (num_q_heads // num_kv_heads)``).

    A row's values do not depend on how the rows were sliced; sums over rows (step and
    head scores) add the slices' partial sums, equal to one slice's to float32 rounding.
    """

    needs: ScoreNeeds
    q_len: int
    num_kv_heads: int = 0  # needed for groups "head"
    num_layers: int = 0
    step: torch.Tensor | None = None
    window_rows: torch.Tensor | None = None
    heads: list[torch.Tensor] = field(default_factory=list)
    layer_steps: list[torch.Tensor] = field(default_factory=list)  # grouped: per layer
    layer_rows: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.q_len < 1:
            raise ValueError(f"need at least one query row, got q_len {self.q_len}")
        if self.needs.groups == "head" and self.num_kv_heads < 1:
            raise ValueError("per-head statistics need the model's KV head count")

    @property
    def grouped(self) -> bool:
        return self.needs.groups != "request"

    @property
    def window_start(self) -> int:
        return self.q_len - min(max(self.needs.query_window, 1), self.q_len)

    @property
    def first_row(self) -> int:
        """The first query row a statistic asked for reads."""
        return 0 if self.needs.step_scores else self.window_start

    def add_layer(self, slices: Iterable[tuple[int, torch.Tensor]]) -> None:
        """One layer's rows ``[first_row, q_len)`` (at least), as ``(first row, float32
        [num_q_heads, rows, n_live])`` slices in any order, each row once. A slice is
        dropped before the next is pulled, so a generator of slices holds one at a time."""
        head_sums: torch.Tensor | None = None
        # One set per request sums over layers as it goes; grouped, each layer its own.
        sums = (None, None) if self.grouped else (self.step, self.window_rows)
        for first, probabilities in slices:
            sums, head_sums = self._add_slice(first, probabilities.float(), sums, head_sums)
            del probabilities
        if self.grouped:
            for target, value in zip((self.layer_steps, self.layer_rows), sums, strict=True):
                if value is not None:
                    target.append(value)
        else:
            self.step, self.window_rows = sums
        if self.needs.per_head:
            if head_sums is None:
                raise ValueError("the slices of a layer lack its window rows")
            self.heads.append(head_sums)
        self.num_layers += 1

    def _mean_heads(self, probabilities: torch.Tensor) -> torch.Tensor:
        """``[rows, n_live]`` mean over heads, or ``[rows, Hkv, n_live]`` per KV head."""
        if self.needs.groups != "head":
            return probabilities.mean(0)
        num_q_heads, rows, n = probabilities.shape
        if num_q_heads % self.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads over {self.num_kv_heads} KV heads")
        grouped = probabilities.view(self.num_kv_heads, -1, rows, n).mean(1)
        return grouped.transpose(0, 1)

    def _add_slice(
        self,
        first: int,
        probabilities: torch.Tensor,
        sums: tuple[torch.Tensor | None, torch.Tensor | None],
        head_sums: torch.Tensor | None,
    ) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], torch.Tensor | None]:
        """One slice into the sums ``(step, window rows)``; returns them and the layer's
        per-head sums so far."""
        step, window_rows = sums
        window_start = self.window_start
        low, high = max(first, window_start), first + probabilities.shape[1]
        rows = slice(low - first, high - first)
        if self.needs.step_scores:
            mean = self._mean_heads(probabilities)  # [rows, (Hkv,) n_live]
            part = mean.sum(0)
            step = part if step is None else step + part
            mean = mean[rows]
        elif low < high:
            mean = self._mean_heads(probabilities[:, rows])
        if low >= high:
            return (step, window_rows), head_sums
        if self.needs.query_window:
            if window_rows is None:
                window_rows = mean.new_zeros(self.q_len - window_start, *mean.shape[1:])
            window_rows[low - window_start : high - window_start] += mean
        if self.needs.per_head:
            part = probabilities[:, rows].sum(1)
            head_sums = part if head_sums is None else head_sums + part
        return (step, window_rows), head_sums

    def reduced(self) -> ReducedAttention:
        if not self.num_layers:
            raise ValueError("no attention layer to reduce")
        if self.grouped:
            return ReducedAttention(
                step_scores=torch.stack(self.layer_steps) if self.layer_steps else None,
                window_rows=torch.stack(self.layer_rows, dim=1) if self.layer_rows else None,
                head_scores=torch.stack(self.heads) if self.needs.per_head else None,
            )
        return ReducedAttention(
            step_scores=None if self.step is None else self.step / self.num_layers,
            window_rows=None if self.window_rows is None else self.window_rows / self.num_layers,
            head_scores=torch.stack(self.heads) if self.needs.per_head else None,
        )
