"""Worker-side vToken: repack before the forward, physical offsets, attention statistics.

One ``VTokenWorker`` per model runner (built by ``workers/vllm_patches/runner_hooks.py``).
It holds no token tables: the scheduler decides, the worker copies. Per step:

1. ``repack`` the KV moves of ``StepOps`` in every layer (``kernels.repack``; synchronous
   on CPU, so done before the forward reads or writes any moved slot; on CUDA checked on
   the host and queued on a side stream, the compute stream fenced after it:
   ``kernels.async_repack``);
2. remember ``num_evicted`` per request: positions stay logical, ``seq_lens`` and slot
   positions subtract it (``physical_offsets``);
3. while a scored policy runs, attention layers hand their queries to ``record``; after
   the forward ``step_scores`` turns them into per-request ``StepAttention`` over the
   request's physical slots ``[0, seq_len)``, reduced by the reference engine's function
   (``workers/statistics.py``): mean over query heads and scored layers. In a
   tensor-parallel engine each rank scores its own heads and ``RankReduction`` combines
   them over the ranks before the driver returns them (``workers/tensor_parallel.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from kernels import KVLayout
from kernels.async_repack import SideStreamRepacker
from kernels.attention_scores import attention_probabilities, summed_attention_mass
from kernels.layout import distinct_layer_caches
from kernels.repack_cpu import load_library
from vtoken.policy import ScoreNeeds, StepAttention
from workers.config import VTokenConfig
from workers.messages import StepOps, StepScores
from workers.statistics import reduce_attention
from workers.tensor_parallel import RankReduction


@dataclass(slots=True)
class CapturedQuery:
    """One scored layer's queries of the step: ``[num_tokens, num_q_heads, head_dim]``."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    scale: float


@dataclass(frozen=True, slots=True)
class ScoredRequest:
    """Where one request sits in the step's batch."""

    request_id: str
    query_start: int
    query_len: int
    seq_len: int  # physical
    block_ids: np.ndarray  # the request's block table row (at least ceil(seq_len / bs))


class VTokenWorker:
    """Per-runner state; see the module docstring."""

    def __init__(
        self,
        config: VTokenConfig,
        layout: KVLayout,
        num_layers: int,
        ranks: RankReduction | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.ranks = ranks or RankReduction()  # one rank unless tensor-parallel
        self.score_layers = set(config.layer_ids(num_layers))
        self.num_evicted: dict[str, int] = {}
        self.score_needs: dict[str, ScoreNeeds] = {}
        self.captured: dict[int, CapturedQuery] = {}
        self.num_moves = 0
        # This rank's shard (tensor parallelism: every rank moves its own shard alike, in
        # about the same time; the driver's figures are the ones reported):
        self.repack_bytes = 0  # read (and as many written) by every repack since start
        self.repack_s = 0.0  # the copies' own time (CPU: wall; CUDA: side-stream events)
        self._slot_bytes: int | None = None  # bytes of one slot over every distinct layer
        self._repacker: SideStreamRepacker | None = None

    @property
    def capturing(self) -> bool:
        return bool(self.score_needs)

    def begin_step(self, ops: StepOps, kv_caches: Sequence[torch.Tensor]) -> None:
        """Apply the repack and take the step's offsets (before the forward)."""
        if ops.num_moves:
            device = kv_caches[0].device
            if device.type == "cuda":
                # Checked on the host, copied on a side stream; the fence orders the
                # forward queued next after the copies (kernels/async_repack.py).
                if self._repacker is None:
                    self._repacker = SideStreamRepacker(device)
                caches = distinct_layer_caches(kv_caches)
                self._repacker.submit(caches, ops.src_slots, ops.dst_slots, self.layout)
                self._repacker.fence()
            else:
                load_library()  # built or loaded once, before the clock starts
                started = time.perf_counter()
                src = torch.from_numpy(ops.src_slots).to(device)
                dst = torch.from_numpy(ops.dst_slots).to(device)
                kernels.repack(distinct_layer_caches(kv_caches), src, dst, self.layout)
                self.repack_s += time.perf_counter() - started
            self.num_moves += ops.num_moves
            self.repack_bytes += ops.num_moves * self.slot_bytes(kv_caches)
        self.num_evicted = dict(ops.num_evicted)
        self.score_needs = dict(ops.score_needs)
        self.captured.clear()

    def slot_bytes(self, kv_caches: Sequence[torch.Tensor]) -> int:
        """Bytes one move copies: a slot's K and V in every distinct layer cache."""
        if self._slot_bytes is None:
            self._slot_bytes = sum(
                cache.numel()
                * cache.element_size()
                // (self.layout.num_blocks(cache) * self.layout.block_size(cache))
                for cache in distinct_layer_caches(kv_caches)
            )
        return self._slot_bytes

    def repack_totals(self) -> tuple[int, float]:
        """Bytes and seconds of every repack since start (CUDA: those that have run)."""
        if self._repacker is not None:
            self.repack_s += self._repacker.take_elapsed_s()
        return self.repack_bytes, self.repack_s

    def physical_offsets(self, request_ids: Sequence[str]) -> np.ndarray:
        """``[len(request_ids)]`` int32: logical minus physical token count (0 if unmanaged)."""
        return np.array([self.num_evicted.get(r, 0) for r in request_ids], dtype=np.int32)

    def record(self, layer_id: int, query: torch.Tensor, kv_cache: torch.Tensor, scale: float):
        """Called by each attention layer after it wrote its KV (``query`` is copied)."""
        if self.capturing and layer_id in self.score_layers:
            self.captured[layer_id] = CapturedQuery(query.detach().clone(), kv_cache, scale)

    def step_scores(self, requests: Sequence[ScoredRequest]) -> StepScores | None:
        """Attention statistics of the requests that asked for them (after the forward),
        with the repack totals; ``None`` while there is neither."""
        repack_bytes, repack_s = self.repack_totals()
        if not self.capturing:
            if not repack_bytes:
                return None
            return StepScores({}, repack_bytes, repack_s)
        layers = [self.captured[i] for i in sorted(self.captured)]
        if not layers:
            raise RuntimeError("vToken: no attention layer reported its queries this step")
        scored = [r for r in requests if r.request_id in self.score_needs and r.query_len > 0]
        mass_only = [r for r in scored if not self._needs_rows(r.request_id)]
        attention = self._attention_mass(layers, mass_only) if mass_only else {}
        rows = [r for r in scored if r.request_id not in attention]
        full = {r.request_id: self._full_attention(layers, r) for r in rows}
        device = layers[0].kv_cache.device
        attention.update(self.ranks.mean_over_ranks(full, [r.request_id for r in rows], device))
        self.captured.clear()
        return StepScores(attention, repack_bytes, repack_s)

    def _needs_rows(self, request_id: str) -> bool:
        """Whether the request's policy reads more than the per-key mass (query rows of a
        window, per-head statistics)."""
        needs = self.score_needs[request_id]
        return bool(needs.query_window or needs.per_head)

    def _attention_mass(
        self, layers: list[CapturedQuery], requests: list[ScoredRequest]
    ) -> dict[str, StepAttention]:
        """Per-key attention mass of the requests whose policies need only that: one score
        call per layer for all of them (one batched kernel on CUDA, one padded matmul for
        the decode rows on CPU), summed over layers and heads on the device, one copy to
        the host (:func:`kernels.attention_scores.summed_attention_mass`)."""
        table = np.zeros((len(requests), max(len(r.block_ids) for r in requests)), np.int32)
        for row, request in enumerate(requests):
            table[row, : len(request.block_ids)] = request.block_ids
        block_tables = torch.from_numpy(table).to(layers[0].kv_cache.device)
        seq_lens = [r.seq_len for r in requests]
        total = summed_attention_mass(
            [(layer.query, layer.kv_cache, layer.scale) for layer in layers],
            block_tables,
            [r.query_start for r in requests],
            [r.query_len for r in requests],
            seq_lens,
            self.layout,
        )
        total = self.ranks.sum_mass(total)  # every rank's heads
        num_q_heads = layers[0].query.shape[1] * self.ranks.world_size
        scores = (total / (num_q_heads * len(layers))).cpu().numpy()
        bounds = np.cumsum([0, *seq_lens])
        return {
            request.request_id: StepAttention(step_scores=scores[bounds[i] : bounds[i + 1]])
            for i, request in enumerate(requests)
        }

    def _full_attention(self, layers: list[CapturedQuery], request: ScoredRequest) -> StepAttention:
        """Per-query probabilities, for window rows and per-head statistics."""
        rows = slice(request.query_start, request.query_start + request.query_len)
        block_table = torch.from_numpy(request.block_ids.astype(np.int64))
        probabilities = (  # one layer at a time: [num_q_heads, q_len, seq_len]
            attention_probabilities(
                layer.query[rows],
                layer.kv_cache,
                block_table.to(layer.kv_cache.device),
                request.seq_len,
                self.layout,
                scale=layer.scale,
            ).cpu()
            for layer in layers
        )
        needs = self.score_needs[request.request_id]
        return reduce_attention(probabilities, needs)
