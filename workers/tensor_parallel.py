"""Attention statistics of a tensor-parallel engine, combined over its ranks.

vLLM shards attention heads over the tensor-parallel group: rank ``r`` of ``W`` holds
query heads ``[r * h, (r + 1) * h)`` (``h = num_heads / W``; vLLM refuses a head count
``W`` does not divide) and their KV heads, and keeps its own shard of every layer's KV
cache. Every rank gets the same ``SchedulerOutput`` (so the same ``StepOps``: each repacks
its shard with the same moves) and scores its own heads; only the driver rank's
``ModelRunnerOutput`` reaches the scheduler. So before a worker returns its statistics,
``RankReduction`` combines the ranks' on vLLM's tensor-parallel group, and the scheduler,
the one place where eviction is decided, sees statistics of every head. Decisions are made
once and broadcast with the next step's ``StepOps``, so every rank applies the same ones.

The calls are collective: every rank makes them in the same order with the same shapes.
That holds because what decides them (who is scored, with which needs, over how many
physical slots) comes from the ``SchedulerOutput`` and the batch state that every rank
derives alike from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vtoken.policy import StepAttention

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sum over the ranks
AllGather = Callable[[torch.Tensor, int], torch.Tensor]  # ranks' tensors in rank order on dim


@dataclass(frozen=True, slots=True)
class RankReduction:
    """How one worker's statistics become the engine's. ``world_size == 1``: unchanged."""

    world_size: int = 1
    all_reduce: AllReduce | None = None
    all_gather: AllGather | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.world_size > 1 and (self.all_reduce is None or self.all_gather is None):
            raise ValueError("a tensor-parallel reduction needs all_reduce and all_gather")

    @classmethod
    def of_vllm_group(cls, tensor_parallel_size: int) -> RankReduction:
        """vLLM's tensor-parallel group of this worker (NCCL on CUDA, shared memory or gloo
        on CPU: tensors stay on the caches' device); one rank needs no group. Raises
        ``RuntimeError`` when the group vLLM built does not have ``tensor_parallel_size``
        ranks (scores would be summed over the wrong heads)."""
        if tensor_parallel_size == 1:
            return cls()
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()  # asserts that vLLM initialised it
        if group.world_size != tensor_parallel_size:
            raise RuntimeError(
                f"vToken: tensor-parallel group of {group.world_size} ranks,"
                f" configured {tensor_parallel_size}"
            )
        return cls(group.world_size, group.all_reduce, group.all_gather)

    def sum_mass(self, total: torch.Tensor) -> torch.Tensor:
        """``total`` (attention mass summed over this rank's heads) summed over every
        rank's heads: divide by ``world_size * local heads`` for the mean."""
        if self.world_size == 1:
            return total
        assert self.all_reduce is not None
        return self.all_reduce(total.contiguous())

    def mean_over_ranks(
        self, attention: dict[str, StepAttention], order: Sequence[str], device: torch.device
    ) -> dict[str, StepAttention]:
        """Per-rank statistics (``workers/statistics.py``: means over this rank's heads)
        -> the engine's: ``step_scores`` and ``window_rows`` averaged over the ranks (every
        rank has as many heads, so that is the mean over all heads), ``head_scores``
        ``[layers, heads, n_live]`` gathered in rank order (global head order). ``order``
        lists ``attention``'s requests in the same order on every rank. One all-reduce and
        at most one all-gather for all requests, on ``device`` (NCCL needs CUDA tensors)."""
        if self.world_size == 1 or not attention:
            return attention
        assert self.all_reduce is not None and self.all_gather is not None
        means = [
            array
            for request_id in order
            for array in (attention[request_id].step_scores, attention[request_id].window_rows)
            if array is not None
        ]
        reduced = iter(self._split(self._reduce_flat(means, device), means))
        heads = [h for r in order if (h := attention[r].head_scores) is not None]
        gathered = iter(self._gather_heads(heads, device))
        combined = {}
        for request_id in order:
            stats = attention[request_id]
            combined[request_id] = StepAttention(
                step_scores=None if stats.step_scores is None else next(reduced),
                window_rows=None if stats.window_rows is None else next(reduced),
                head_scores=None if stats.head_scores is None else next(gathered),
            )
        return combined

    def _reduce_flat(self, arrays: list[np.ndarray], device: torch.device) -> np.ndarray:
        if not arrays:
            return np.zeros(0, np.float32)
        assert self.all_reduce is not None
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]).astype(np.float32))
        total = self.all_reduce(flat.to(device))
        return (total / self.world_size).cpu().numpy()

    @staticmethod
    def _split(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
        bounds = np.cumsum([0, *(a.size for a in like)])
        return [flat[bounds[i] : bounds[i + 1]].reshape(a.shape) for i, a in enumerate(like)]

    def _gather_heads(self, heads: list[np.ndarray], device: torch.device) -> list[np.ndarray]:
        """``[layers, local heads, n_i]`` per request -> ``[layers, all heads, n_i]``."""
        if not heads:
            return []
        assert self.all_gather is not None
        joined = torch.from_numpy(np.concatenate(heads, axis=2).astype(np.float32))
        everyone = self.all_gather(joined.to(device), 1).cpu().numpy()
        bounds = np.cumsum([0, *(h.shape[2] for h in heads)])
        return [everyone[:, :, bounds[i] : bounds[i + 1]] for i in range(len(heads))]
