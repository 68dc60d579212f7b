"""Worker-side vToken: repack before the forward, physical offsets, attention statistics.

One ``VTokenWorker`` per model runner (built by ``workers/vllm_patches/runner_hooks.py``).
It holds no token tables: the scheduler decides, the worker copies. Per step:

1. ``repack`` the KV moves of ``StepOps`` in every layer (``kernels.repack``; synchronous
   on CPU, so done before the forward reads or writes any moved slot; on CUDA checked on
   the host and queued on a side stream, the compute stream fenced after it:
   ``kernels.async_repack``);
2. remember ``num_evicted`` per request: positions stay logical, ``seq_lens`` and slot
   positions subtract it (``physical_offsets``);
3. while a scored policy runs, ``select_scored`` (from ``_prepare_inputs``) names the
   batch rows of the scored requests' queries and each scored attention layer hands its
   query to ``record``, which gathers those rows into the capture buffer allocated at
   start (``workers/query_capture.py``); after the forward ``launch_scores`` queues the
   per-request ``StepAttention`` over the request's physical slots ``[0, seq_len)``,
   reduced by the reference engine's function (``workers/statistics.py``): mean over
   query heads and scored layers. In a tensor-parallel engine each rank scores its own
   heads and ``RankReduction`` combines them over the ranks before the driver returns
   them (``workers/tensor_parallel.py``).
4. ``take_scores`` (after sampling) hands the step's ``StepScores`` over. On CUDA the
   scores run on a side stream after the forward and reach pinned host memory with
   ``non_blocking`` copies; the host waits for them (one event) only after vLLM's
   sampling was queued and read back, so sampling never waits for the scores, and the
   policy still sees the scores of the step it decides on (on CPU everything runs in
   order; the decisions are the same on both).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

import kernels
from kernels import KVLayout
from kernels.async_repack import SideStreamRepacker
from kernels.attention_scores import summed_attention_mass
from kernels.grouped_repack import grouped_repack
from kernels.layout import distinct_layer_caches
from kernels.repack_cpu import load_library
from kernels.row_probabilities import MAX_SLICE_BYTES, probability_slices
from vtoken.policy import ScoreNeeds, StepAttention
from workers.config import VTokenConfig
from workers.messages import StepOps, StepScores
from workers.query_capture import QueryCapture, RecordedLayer, to_device
from workers.statistics import AttentionSums, ReducedAttention
from workers.tensor_parallel import RankReduction


@dataclass(frozen=True, slots=True)
class ScoredRequest:
    """Where one request sits in the step's batch."""

    request_id: str
    query_start: int  # its first row in the batch
    query_len: int
    seq_len: int  # physical
    block_ids: np.ndarray  # the request's block table row (at least ceil(seq_len / bs))


@dataclass(slots=True)
class _PendingScores:
    """Scores queued by ``launch_scores``: host tensors (pinned on CUDA) that are complete
    once ``done`` has passed (``None``: already complete)."""

    mass_requests: list[ScoredRequest]
    mass: torch.Tensor | None  # float32 [sum of their seq_lens]
    rows: dict[str, ReducedAttention]  # requests that need more than the mass
    done: torch.cuda.Event | None


class VTokenWorker:
    """Per-runner state; see the module docstring. ``capture`` holds the scored layers'
    queries (``workers/query_capture.py``; its layers are ``config.layer_ids``)."""

    def __init__(
        self,
        config: VTokenConfig,
        layout: KVLayout,
        capture: QueryCapture,
        ranks: RankReduction | None = None,
        *,
        max_slice_bytes: int = MAX_SLICE_BYTES,
    ) -> None:
        self.config = config
        self.layout = layout
        self.capture = capture
        self.ranks = ranks or RankReduction()  # one rank unless tensor-parallel
        self.max_slice_bytes = max_slice_bytes  # window and per-head scores' temporary
        self.num_evicted: dict[str, int] = {}
        self.score_needs: dict[str, ScoreNeeds] = {}
        self.num_moves = 0
        # This rank's shard (tensor parallelism: every rank moves its own shard alike, in
        # about the same time; the driver's figures are the ones reported):
        self.repack_bytes = 0  # read (and as many written) by every repack since start
        self.repack_s = 0.0  # the copies' own time (CPU: wall; CUDA: side-stream events)
        self._slot_bytes: int | None = None  # bytes of one slot over every distinct layer
        self._repacker: SideStreamRepacker | None = None
        self._score_stream: torch.cuda.Stream | None = None
        self._pending: _PendingScores | None = None
        self._launched = False

    @property
    def capturing(self) -> bool:
        return bool(self.score_needs)

    @property
    def score_layers(self) -> set[int]:
        return set(self.capture.layer_ids)

    @property
    def captured(self) -> dict[int, RecordedLayer]:
        """The scored layers that recorded their queries this step."""
        return self.capture.recorded

    def begin_step(self, ops: StepOps, kv_caches: Sequence[torch.Tensor]) -> None:
        """Apply the repack and take the step's offsets (before the forward)."""
        if self._pending is not None and self._pending.done is not None:
            # Scores never taken (no sampling followed): the repack (ordered after the
            # compute stream) and the forward about to overwrite the capture buffer wait
            # for the side stream that reads the caches and the buffer.
            torch.cuda.current_stream().wait_event(self._pending.done)
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
        if ops.grouped.num_moves:
            self._grouped_repack(ops, kv_caches)
        self.num_evicted = dict(ops.num_evicted)
        self.score_needs = dict(ops.score_needs)
        self.capture.recorded.clear()
        self._pending, self._launched = None, False

    def _grouped_repack(self, ops: StepOps, kv_caches: Sequence[torch.Tensor]) -> None:
        """The moves of requests that keep a set per layer or (layer, KV head): K and V of
        one head of one layer each (``kernels/grouped_repack.py``; CPU only, and every
        layer its own cache: engines that cannot run it refuse such policies at start)."""
        if kv_caches[0].device.type != "cpu" or len(distinct_layer_caches(kv_caches)) != len(
            kv_caches
        ):
            raise RuntimeError("vToken: per-layer or per-head repacks run on CPU caches only")
        moves = ops.grouped
        started = time.perf_counter()
        layers, heads, src, dst = (
            torch.from_numpy(a)
            for a in (moves.layers, moves.heads, moves.src_slots, moves.dst_slots)
        )
        grouped_repack(kv_caches, layers, heads, src, dst, self.layout)
        self.repack_s += time.perf_counter() - started
        self.num_moves += moves.num_moves
        num_parts = self.layout.num_kv_heads(kv_caches[0]) * len(kv_caches)  # of one slot
        self.repack_bytes += moves.num_moves * self.slot_bytes(kv_caches) // num_parts

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

    def select_scored(self, request_ids: Sequence[str], query_starts: np.ndarray) -> None:
        """Before the forward: the batch rows to capture, those of the requests scored this
        step (``query_starts``: ``[len(request_ids) + 1]``, the batch's row offsets)."""
        if not self.capturing:
            return
        self.capture.select(
            {
                request_id: (int(query_starts[i]), int(query_starts[i + 1] - query_starts[i]))
                for i, request_id in enumerate(request_ids)
                if request_id in self.score_needs
            }
        )

    def launch_scores(self, requests: Sequence[ScoredRequest]) -> None:
        """After the forward: queue the attention statistics of the requests that asked for
        them (on CUDA on a side stream, read back into pinned memory without waiting)."""
        self._launched = True
        if not self.capturing:
            return
        layers = [self.captured[i] for i in sorted(self.captured)]
        if not layers:
            raise RuntimeError("vToken: no attention layer reported its queries this step")
        starts = self.capture.starts
        scored = [
            replace(r, query_start=starts[r.request_id])
            for r in requests
            if r.request_id in starts and r.request_id in self.score_needs
        ]
        device = layers[0].kv_cache.device
        if device.type != "cuda":
            self._pending = self._queue_scores(layers, scored, device)
            return
        if self._score_stream is None:
            self._score_stream = torch.cuda.Stream(device)
        self._score_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._score_stream):
            self._pending = self._queue_scores(layers, scored, device)
            done = torch.cuda.Event()
            done.record(self._score_stream)
            self._pending.done = done

    def take_scores(self) -> StepScores | None:
        """The step's ``StepScores`` (after sampling: waits for the queued scores), with the
        repack totals; ``None`` while there is neither, or once taken."""
        if not self._launched:
            return None
        self._launched = False
        pending, self._pending = self._pending, None
        repack_bytes, repack_s = self.repack_totals()
        if pending is None:
            return StepScores({}, repack_bytes, repack_s) if repack_bytes else None
        if pending.done is not None:
            pending.done.synchronize()
        attention: dict[str, StepAttention] = {}
        if pending.mass is not None:
            scores = pending.mass.numpy()
            bounds = np.cumsum([0, *(r.seq_len for r in pending.mass_requests)])
            for i, request in enumerate(pending.mass_requests):
                mass = scores[bounds[i] : bounds[i + 1]].copy()
                needs = self.score_needs[request.request_id]
                attention[request.request_id] = StepAttention(
                    step_scores=mass if needs.step_scores or not needs.query_window else None,
                    window_rows=mass[None] if needs.query_window else None,
                )
        full = {request_id: rows.to_step_attention() for request_id, rows in pending.rows.items()}
        device = self.capture.device
        attention.update(self.ranks.mean_over_ranks(full, list(pending.rows), device))
        return StepScores(attention, repack_bytes, repack_s)

    def _queue_scores(
        self, layers: list[RecordedLayer], scored: list[ScoredRequest], device: torch.device
    ) -> _PendingScores:
        by_mass = [self._as_mass(r) for r in scored]
        mass_only = [r for r in by_mass if r is not None]
        mass = self._attention_mass(layers, mass_only) if mass_only else None
        rows = {
            r.request_id: self._full_attention(layers, r)
            for r, m in zip(scored, by_mass, strict=True)
            if m is None
        }
        return _PendingScores(mass_only, mass, rows, None)

    def _as_mass(self, request: ScoredRequest) -> ScoredRequest | None:
        """The request as the batched mass kernel scores it, or ``None`` where its policy
        reads more than one query row's mass (per-head statistics, several window rows).

        One window row is the mass of that row alone: a decode step's only query, or a
        prefill chunk's last query when nothing else is asked for (TOVA). Such requests
        join the batched mass path (one launch per layer for all of them) instead of
        materialising every scored layer's probabilities one request at a time.
        """
        needs = self.score_needs[request.request_id]
        if needs.per_head or needs.groups != "request":  # the batched mass sums every layer
            return None
        if not needs.query_window or request.query_len == 1:
            return request
        if needs.query_window == 1 and not needs.step_scores:
            last = request.query_start + request.query_len - 1
            return replace(request, query_start=last, query_len=1)
        return None

    def _attention_mass(
        self, layers: list[RecordedLayer], requests: list[ScoredRequest]
    ) -> torch.Tensor:
        """Per-key attention mass of the requests whose policies need only that, float32
        ``[sum of their seq_lens]`` on the host: one score call per layer for all of them
        (one batched kernel on CUDA, one padded matmul for the decode rows on CPU), summed
        over layers and heads on the device, one copy to the host
        (:func:`kernels.attention_scores.summed_attention_mass`)."""
        table = np.zeros((len(requests), max(len(r.block_ids) for r in requests)), np.int32)
        for row, request in enumerate(requests):
            table[row, : len(request.block_ids)] = request.block_ids
        device = layers[0].kv_cache.device
        total = summed_attention_mass(
            [(layer.query, layer.kv_cache, layer.scale) for layer in layers],
            to_device(table, device),
            [r.query_start for r in requests],
            [r.query_len for r in requests],
            [r.seq_len for r in requests],
            self.layout,
        )
        total = self.ranks.sum_mass(total)  # every rank's heads
        num_q_heads = layers[0].query.shape[1] * self.ranks.world_size
        return _to_host(total / (num_q_heads * len(layers)))

    def _full_attention(
        self, layers: list[RecordedLayer], request: ScoredRequest
    ) -> ReducedAttention:
        """Window rows and per-head statistics from per-query probabilities, reduced on the
        device, then copied to the host. Each layer's logits of the rows a statistic reads
        are computed once, in slices of rows whose float32 logits and probabilities stay
        under ``max_slice_bytes`` (``kernels/row_probabilities.py``), each reduced
        (``AttentionSums``) before the next is computed: a long prefill scored over every
        layer never holds more than one slice."""
        rows = slice(request.query_start, request.query_start + request.query_len)
        device = layers[0].kv_cache.device
        block_table = to_device(request.block_ids.astype(np.int64), device)
        kv_heads = self.layout.num_kv_heads(layers[0].kv_cache)
        sums = AttentionSums(self.score_needs[request.request_id], request.query_len, kv_heads)
        for layer in layers:
            sums.add_layer(
                probability_slices(
                    layer.query[rows],
                    layer.kv_cache,
                    block_table,
                    request.seq_len,
                    self.layout,
                    scale=layer.scale,
                    first_row=sums.first_row,
                    max_bytes=self.max_slice_bytes,
                )
            )
        return sums.reduced().map(_to_host)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host; from CUDA a ``non_blocking`` copy into pinned memory (valid
    once the stream's later event has passed)."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
