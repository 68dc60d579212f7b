"""The queries of a step's scored requests, in one buffer allocated before vLLM measures
memory, and the host-to-device uploads of a step, none of which makes the host wait.

``CaptureSize`` is the buffer's size, fixed at start from the engine:

    bytes = num_scored_layers * max_num_batched_tokens * num_q_heads * head_size * itemsize

(``num_q_heads``: this rank's query heads; ``itemsize``: the model dtype's, 2 for
bf16/fp16). ``allocate_capture`` runs right after the model is loaded, before vLLM's
profiling run, so the KV pool vLLM sizes from the memory left accounts for it (for
Llama-3.1-8B scoring all 32 layers at 8,192 batched tokens: 32 * 8192 * 32 * 128 * 2 bytes
= 2 GiB; scoring 4 layers: 256 MiB).

``QueryCapture`` holds it. Per step, ``select`` takes the batch rows of the scored
requests' query tokens (in batch order); each scored layer's ``record`` gathers those rows
of its query into its slice of the buffer (no allocation the size of the batch). Captured
row ``i`` of a layer is the query of the ``i``-th selected token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# Turns a layer's gathered query rows into the values its logits use (fp8 dequantization,
# FlashInfer's query quantization): ``(rows, batch_row_indices) -> rows``.
QueryConversion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without the host waiting: on CUDA copied from pinned memory
    (PyTorch's caching host allocator keeps the pinned block until the copy has run) with
    ``non_blocking``; elsewhere the array's own memory."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class CaptureSize:
    """The capture buffer's shape: ``[num_layers, max_num_tokens, num_q_heads,
    head_size]`` of ``dtype``."""

    num_layers: int  # scored layers
    max_num_tokens: int  # the engine's max_num_batched_tokens
    num_q_heads: int  # this rank's
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_layers, self.max_num_tokens, self.num_q_heads, self.head_size) < 1:
            raise ValueError(f"every capture dimension must be positive: {self}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.max_num_tokens, self.num_q_heads, self.head_size)

    @property
    def num_bytes(self) -> int:
        """The module docstring's formula."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.max_num_tokens * self.num_q_heads * self.head_size * itemsize


@dataclass(slots=True)
class RecordedLayer:
    """One scored layer of the step: its captured rows ``[num_rows, num_q_heads,
    head_size]`` (a view of the buffer), the cache its keys are read from, the logits'
    scale."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    scale: float


@dataclass(slots=True)
class QueryCapture:
    """The buffer and the step's selection. ``layer_ids``: the scored layers, each with
    its slice of ``queries`` (``layer_ids[i]`` -> ``queries[i]``)."""

    size: CaptureSize
    layer_ids: Sequence[int]
    device: torch.device
    queries: torch.Tensor = field(init=False)
    num_rows: int = field(init=False, default=0)
    starts: dict[str, int] = field(init=False, default_factory=dict)
    recorded: dict[int, RecordedLayer] = field(init=False, default_factory=dict)
    _slots: dict[int, int] = field(init=False, default_factory=dict)
    _rows: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if len(self.layer_ids) != self.size.num_layers:
            raise ValueError(f"{len(self.layer_ids)} scored layers, sized for {self.size}")
        self.queries = torch.empty(self.size.shape, dtype=self.size.dtype, device=self.device)
        self._slots = {layer_id: slot for slot, layer_id in enumerate(self.layer_ids)}
        self._rows = torch.zeros(0, dtype=torch.int64, device=self.device)

    def select(self, query_starts: dict[str, tuple[int, int]]) -> None:
        """The step's scored requests: ``request_id -> (first batch row, num rows)``, in
        batch order. Raises ``ValueError`` past ``max_num_tokens`` rows (vLLM never
        schedules more)."""
        spans = [(start, length) for start, length in query_starts.values() if length > 0]
        rows = np.concatenate([np.arange(s, s + n) for s, n in spans]) if spans else np.zeros(0)
        if rows.size > self.size.max_num_tokens:
            raise ValueError(f"{rows.size} scored rows, buffer for {self.size.max_num_tokens}")
        self.num_rows = int(rows.size)
        self.starts.clear()
        offset = 0
        for request_id, (_, length) in query_starts.items():
            if length > 0:
                self.starts[request_id] = offset
                offset += length
        self._rows = to_device(rows.astype(np.int64), self.device)
        self.recorded.clear()

    def record(
        self,
        layer_id: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        convert: QueryConversion | None = None,
    ) -> None:
        """Gather the selected rows of ``query`` (``[num_tokens, num_q_heads, head_size]``)
        into the layer's slice; ``convert`` (if any) applies to the gathered rows."""
        slot = self._slots.get(layer_id)
        if slot is None:
            return
        out = self.queries[slot, : self.num_rows]
        if self.num_rows:
            if convert is None and query.dtype == out.dtype:
                torch.index_select(query, 0, self._rows, out=out)
            else:
                rows = query.index_select(0, self._rows)
                out.copy_(rows if convert is None else convert(rows, self._rows))
        self.recorded[layer_id] = RecordedLayer(out, kv_cache, scale)


def capture_size(vllm_config: Any, num_scored_layers: int) -> CaptureSize:
    """``CaptureSize`` of a vLLM engine's config (this rank's heads)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return CaptureSize(
        num_layers=num_scored_layers,
        max_num_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        num_q_heads=model.get_num_attention_heads(parallel),
        head_size=model.get_head_size(),
        dtype=model.dtype,
    )
