"""The step-time model: how long one engine step takes on a device, from what it scheduled.

A step's time (``StepCost.total_s``) is

    host + max(weights read + KV read, compute) + scores + repack + tensor-parallel all-reduces

- **host**: the engine's per-step CPU work (scheduler, input preparation, sampling):
  ``host_base_s + host_per_request_s x requests``.
- **weights read**: every parameter byte once per step, ``/ (HBM bandwidth x efficiency)``.
- **KV read**, per engine (``KVReads``): vanilla reads every logical token of context;
  vToken (eager, on_demand) its live tokens, packed; Naive-Evict its held blocks x block
  size (a block-granular kernel reads the masked slots); block eviction its live tokens.
- **compute**: ``2 x parameters`` FLOPs per scheduled token plus the attention's
  ``4 x layers x heads x head_dim`` per query-key pair, ``/ (peak x utilisation)``.
- **scores**: per scored layer, a fixed launch cost plus the scored keys' bytes at a rate,
  fitted (least squares) to the H200 kernel figures in bench/RESULTS.md ("Kernels on a
  GPU", run 4, llama8b shape, one layer, bf16) and scaled to other devices by bandwidth.
- **repack**: a fixed cost per step that moves anything, plus the moved bytes at a rate,
  fitted to the same section's repack rows (all 32 layers per call).
- **all-reduce**: with tensor parallelism, two per layer over ``tokens x hidden`` activations
  (ring: ``2 (t - 1) / t`` of the bytes over the link) plus a latency each.

Constants name their public source beside them. ``efficiency``, ``utilisation`` and the host
time are assumptions, not fitted; gate (c) (``gpu_gate.py``) compares the model with
published serving throughput (docs/simulator.md has the rows it misses). The CPU
profile (``cpu_profile.py``) replaces all of this with a linear fit to a real CPU run's
per-step timings.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np

from sim.replica import StepRecord


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's shapes. ``parameters``: total count (embeddings included)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    parameters: float

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes


# Shapes from the models' config.json on Hugging Face (meta-llama/Llama-3.1-8B and
# meta-llama/Llama-3.1-70B, "num_hidden_layers", "hidden_size", ...); parameter counts from
# the model cards ("8B" 8.03e9, "70B" 70.6e9). SmolLM2-135M: HuggingFaceTB/SmolLM2-135M.
MODELS = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70.6e9),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 1.35e8),
}


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator. Bandwidth in bytes/s, peaks in dense FLOP/s."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    bf16_flops: float
    fp8_flops: float
    link_bandwidth: float  # per direction, to a peer in the same node


# NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e, 4.8 TB/s,
# BF16 989 TFLOPS and FP8 1,979 TFLOPS dense (the sheet's 1,979 / 3,958 are with
# sparsity), NVLink 900 GB/s total (450 GB/s per direction).
# NVIDIA H100 SXM datasheet (nvidia.com/en-us/data-center/h100): 80 GB HBM3, 3.35 TB/s,
# the same BF16 / FP8 peaks and NVLink.
# Memory is what the driver reports as the device's total (nvidia-smi: 143,771 MiB on an
# H200, 81,559 MiB on an H100 SXM 80GB), the figure vLLM's gpu_memory_utilization
# multiplies; the datasheets' "141 GB" and "80 GB" are about 7% less in bytes.
H200_MEMORY_BYTES = 143_771 * 2**20
H100_MEMORY_BYTES = 81_559 * 2**20
DEVICES = {
    "h200": Device("h200", H200_MEMORY_BYTES, 4.8e12, 989e12, 1979e12, 450e9),
    "h100": Device("h100", H100_MEMORY_BYTES, 3.35e12, 989e12, 1979e12, 450e9),
}


class CostModel(Protocol):
    """What the cluster loop asks of a step-time model."""

    def step(self, record: StepRecord, reads: KVReads) -> StepCost: ...


class KVReads(Enum):
    """What an engine's attention reads per scheduled request (module docstring)."""

    CONTEXT = "context"  # vanilla
    LIVE = "live"  # vToken, block eviction
    HELD_BLOCKS = "held_blocks"  # Naive-Evict reading its masked slots


ENGINE_READS = {
    "vanilla": KVReads.CONTEXT,
    "eager": KVReads.LIVE,
    "on_demand": KVReads.LIVE,
    "on_demand_at_budget": KVReads.LIVE,
    "block": KVReads.LIVE,
    "naive": KVReads.HELD_BLOCKS,
}

# bench/RESULTS.md, "Kernels on a GPU", run 4 (H200, llama8b shape, bf16, block 16):
# scores, one layer, q_len 1: (key MB, ms); q_len 32 rows are (key MB, ms) at 32 rows.
H200_SCORE_ROWS_Q1 = ((8.4, 0.274), (268, 0.414), (1074, 0.780), (1074, 1.034), (4295, 2.457))
H200_SCORE_ROWS_Q32 = ((33.6, 0.318), (1074, 6.103), (4295, 24.730))
# repack, all 32 layers per call: (MB moved, ms).
H200_REPACK_ROWS = ((132.5, 0.172), (86.5, 0.140), (117.6, 0.152), (16.8, 0.105), (2.1, 0.095))
H200_BANDWIDTH = DEVICES["h200"].hbm_bandwidth


def _fit_line(rows: tuple[tuple[float, float], ...]) -> tuple[float, float]:
    """Least-squares ``ms = fixed + slope x MB``, both clipped at 0."""
    x = np.array([r[0] for r in rows])
    y = np.array([r[1] for r in rows])
    slope, fixed = np.polyfit(x, y, 1)
    return max(float(fixed), 0.0), max(float(slope), 0.0)


SCORE_FIXED_MS, SCORE_MS_PER_MB = _fit_line(H200_SCORE_ROWS_Q1)
_, SCORE_ROW_MS_PER_MB = _fit_line(tuple((mb * 32, ms) for mb, ms in H200_SCORE_ROWS_Q32))
REPACK_FIXED_MS, REPACK_MS_PER_MB = _fit_line(H200_REPACK_ROWS)


@dataclass(frozen=True, slots=True)
class StepCost:
    host_s: float
    weights_s: float
    kv_s: float
    compute_s: float
    scores_s: float
    repack_s: float
    allreduce_s: float
    kv_bytes: float

    @property
    def total_s(self) -> float:
        memory = self.weights_s + self.kv_s
        return (
            self.host_s
            + max(memory, self.compute_s)
            + self.scores_s
            + self.repack_s
            + self.allreduce_s
        )


@dataclass(frozen=True, slots=True)
class GpuCostModel:
    """The model of the module docstring for one (device, model, dtype, TP) replica.

    ``weight_bytes`` / ``kv_bytes``: bytes per parameter and per KV element (bf16 2, fp8 1).
    ``bandwidth_efficiency``, ``compute_utilisation``, ``host_*`` and
    ``allreduce_latency_s`` are assumptions, not measured here (gate (c), ``gpu_gate.py``,
    checks them).
    """

    device: Device
    model: ModelShape
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    tensor_parallel: int = 1
    block_size: int = 16
    bandwidth_efficiency: float = 0.8
    compute_utilisation: float = 0.6
    host_base_s: float = 2e-3
    host_per_request_s: float = 10e-6
    allreduce_latency_s: float = 8e-6
    score_layers: int | None = None  # None: every layer

    def step(self, record: StepRecord, reads: KVReads) -> StepCost:
        model, device, tp = self.model, self.device, self.tensor_parallel
        bandwidth = device.hbm_bandwidth * self.bandwidth_efficiency * tp
        tokens = {
            KVReads.CONTEXT: record.context_tokens,
            KVReads.LIVE: record.live_tokens,
            KVReads.HELD_BLOCKS: record.held_blocks * self.block_size,
        }[reads]
        kv_bytes = tokens * model.kv_bytes_per_token(self.kv_bytes)
        scheduled = record.prefill_tokens + record.decode_tokens
        peak = device.fp8_flops if self.weight_bytes <= 1 else device.bf16_flops
        per_pair = 4 * model.num_layers * model.num_heads * model.head_dim
        flops = 2 * model.parameters * scheduled + per_pair * record.attention_pairs
        return StepCost(
            host_s=self.host_base_s + self.host_per_request_s * record.num_requests,
            weights_s=model.parameters * self.weight_bytes / bandwidth,
            kv_s=kv_bytes / bandwidth,
            compute_s=flops / (peak * self.compute_utilisation * tp),
            scores_s=self._scores_s(record),
            repack_s=self._repack_s(record),
            allreduce_s=self._allreduce_s(scheduled),
            kv_bytes=kv_bytes,
        )

    def _scale(self) -> float:
        """Kernel times fitted on an H200, on this device (by bandwidth) and TP degree."""
        return H200_BANDWIDTH / (self.device.hbm_bandwidth * self.tensor_parallel)

    def _scores_s(self, record: StepRecord) -> float:
        if not record.scored_tokens:
            return 0.0
        layers = self.score_layers or self.model.num_layers
        keys = record.scored_tokens * self.model.num_kv_heads * self.model.head_dim
        per_layer_mb = keys * self.kv_bytes / 1e6
        ms = SCORE_FIXED_MS + SCORE_MS_PER_MB * per_layer_mb * self._scale()
        return layers * ms / 1e3

    def _repack_s(self, record: StepRecord) -> float:
        if not record.num_moves:
            return 0.0
        mb = record.num_moves * self.model.kv_bytes_per_token(self.kv_bytes) / 1e6
        return (REPACK_FIXED_MS + REPACK_MS_PER_MB * mb * self._scale()) / 1e3

    def _allreduce_s(self, tokens: int) -> float:
        tp = self.tensor_parallel
        if tp == 1 or not tokens:
            return 0.0
        payload = tokens * self.model.hidden_size * 2  # bf16 activations
        ring = 2 * (tp - 1) / tp * payload / self.device.link_bandwidth
        return 2 * self.model.num_layers * (ring + self.allreduce_latency_s)

    def kv_pool_blocks(self, memory_fraction: float = 0.9) -> int:
        """KV blocks one replica holds: device memory x ``memory_fraction`` x TP less the
        weights (activations and graphs are inside the unused fraction)."""
        free = self.device.hbm_bytes * memory_fraction * self.tensor_parallel
        free -= self.model.parameters * self.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} does not fit {self.tensor_parallel} x {self.device.name}"
            )
        per_block = self.model.kv_bytes_per_token(self.kv_bytes) * self.block_size
        return int(free // per_block)


def gpu_cost_model(
    gpu: str, model: str, dtype: str = "bf16", tensor_parallel: int = 1, block_size: int = 16
) -> GpuCostModel:
    """The cost model of ``gpu`` (h200, h100) serving ``model`` (``MODELS``) in ``dtype``
    (bf16, or fp8 weights and KV cache)."""
    if gpu not in DEVICES:
        raise ValueError(f"gpu must be one of {sorted(DEVICES)}, got {gpu!r}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype must be bf16 or fp8, got {dtype!r}")
    if tensor_parallel < 1:
        raise ValueError("tensor_parallel must be >= 1")
    width = 1.0 if dtype == "fp8" else 2.0
    return GpuCostModel(DEVICES[gpu], MODELS[model], width, width, tensor_parallel, block_size)
