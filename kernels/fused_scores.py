"""One score pass per step: the attention mass of every decode row of a step in every
scored layer, summed over the layers and KV heads, in one kernel launch.

``fused_decode_mass(queries, kv_caches, scales, requests, layout)`` returns float32
``[requests.total_keys]``: request ``r``'s keys at ``requests.columns[r]``, each the sum
over the layers and the q heads of ``softmax_j(scale_l * q . k_j)`` of the request's one
query row (so the mass of a request sums to ``num_layers * num_q_heads``). It equals
``kernels.attention_scores.summed_attention_mass`` for decode requests (its torch path on
CPU engines is unchanged); the kernel is ``kernels._fused_scores_triton`` (one pass over
the keys with each row's running maximum and sum, the logits kept in a bounded scratch
and rescaled once).

``DecodeRequests`` is the step's request table on the device, built once per step (one
pinned, non-blocking upload; or from device tensors the runner already has), whatever the
number of layers; the layers' table (offsets, scales) is uploaded once per set of layers.
Layers are addressed as element offsets from the lowest-addressed layer's tensors (vLLM's
per-layer caches are views of one buffer; the captured queries may be one buffer or
separate tensors of one shape), so any number of layers is one launch.
Output columns add in an order that varies between runs (``atomic_add``): the mass is
exact to float32 rounding, not bitwise reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.layout import KVLayout, same_geometry, vector_alignment

# Scratch of all programs together (float32 logits of the rows in flight).
MAX_SCRATCH_BYTES = 256 * 1024 * 1024
PROGRAMS_PER_SM = 4
CPU_PROGRAMS = 3  # under the interpreter: few programs, each taking several items


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array to ``device`` without the host waiting: pinned, non-blocking on CUDA."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class DecodeRequests:
    """A step's decode requests as the fused kernel reads them. ``table``: int64
    ``[num_requests, 4]`` on the device, per request its query row, ``seq_len``, first
    output column and row of ``block_tables`` (``[rows, max_blocks]`` int32/int64).
    ``max_seq_len`` and ``total_keys`` size the launch and the output (host integers: the
    scheduler's)."""

    table: torch.Tensor
    block_tables: torch.Tensor
    num_requests: int
    max_seq_len: int
    total_keys: int

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        query_rows: Sequence[int],
        seq_lens: Sequence[int],
        columns: Sequence[int] | None = None,
        table_rows: Sequence[int] | None = None,
    ) -> DecodeRequests:
        """From host lists: one upload. ``columns`` default: the requests' keys one after
        another (``sum(seq_lens[:r])``); ``table_rows`` default: request ``r``'s blocks in
        row ``r``."""
        if not len(query_rows) == len(seq_lens) or not seq_lens:
            raise ValueError("need as many query rows as seq_lens, at least one")
        if any(int(n) < 1 for n in seq_lens):
            raise ValueError(f"every seq_len must be >= 1, got {list(seq_lens)}")
        lengths = np.asarray(seq_lens, dtype=np.int64)
        if columns is None:
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        else:
            starts = np.asarray(columns, dtype=np.int64)
        rows = np.arange(len(seq_lens)) if table_rows is None else np.asarray(table_rows)
        if block_tables.dim() != 2 or not 0 <= rows.min() <= rows.max() < block_tables.shape[0]:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} lack rows {rows.tolist()}")
        if len(rows) != len(seq_lens) or len(starts) != len(seq_lens):
            raise ValueError("need one column and one table row per request")
        queries = np.asarray(query_rows, dtype=np.int64)
        table = np.stack([queries, lengths, starts, rows.astype(np.int64)], axis=1)
        return cls(
            table=_upload(table, block_tables.device),
            block_tables=block_tables,
            num_requests=len(seq_lens),
            max_seq_len=int(lengths.max()),
            total_keys=int((starts + lengths).max()),
        )

    @classmethod
    def from_device(
        cls,
        block_tables: torch.Tensor,
        query_rows: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> DecodeRequests:
        """From device tensors (``[num_requests]`` integers, e.g. the runner's
        ``seq_lens`` and the last row of each request): no upload, no wait; the columns
        are the requests' keys one after another. ``max_seq_len`` bounds ``seq_lens``
        (the output has ``num_requests * max_seq_len`` columns: read the first
        ``sum(seq_lens)``)."""
        lengths = seq_lens.to(torch.int64)
        starts = torch.cumsum(lengths, 0) - lengths
        num_requests = int(seq_lens.shape[0])
        rows = torch.arange(num_requests, device=seq_lens.device)
        table = torch.stack([query_rows.to(torch.int64), lengths, starts, rows], dim=1)
        return cls(table, block_tables, num_requests, max_seq_len, num_requests * max_seq_len)


def reference_decode_mass(
    queries: Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    scales: Sequence[float],
    block_tables: torch.Tensor,
    query_rows: Sequence[int],
    seq_lens: Sequence[int],
    layout: KVLayout,
) -> torch.Tensor:
    """Plain-torch reference of ``fused_decode_mass`` (columns one request after another):
    per layer and request, the keys gathered slot by slot, one softmax per q head over
    them, summed over the q heads."""
    parts: list[torch.Tensor] = []
    for r, (row, seq_len) in enumerate(zip(query_rows, seq_lens, strict=True)):
        positions = torch.arange(int(seq_len), device=block_tables.device)
        block_size = layout.block_size(kv_caches[0])
        slots = block_tables[r].long()[positions // block_size] * block_size
        slots += positions % block_size
        mass = torch.zeros(int(seq_len), dtype=torch.float32, device=block_tables.device)
        for query, cache, scale in zip(queries, kv_caches, scales, strict=True):
            keys = layout.gather(cache, slots)[:, 0].float()  # [seq_len, kv_heads, head_dim]
            q = query[row].float()  # [q_heads, head_dim]
            keys = keys.repeat_interleave(q.shape[0] // keys.shape[1], dim=1)
            logits = torch.einsum("hd,shd->hs", q, keys) * scale
            mass += logits.softmax(dim=-1).sum(0)
        parts.append(mass)
    return torch.cat(parts)


def _layer_offsets(tensors: Sequence[torch.Tensor], what: str) -> tuple[torch.Tensor, list[int]]:
    """The lowest-addressed tensor and each tensor's element offset from it."""
    base = min(tensors, key=lambda t: t.data_ptr())
    size = base.element_size()
    offsets = []
    for tensor in tensors:
        if not same_geometry(tensor, base):
            raise ValueError(f"{what} of every layer must share shape, strides, dtype and device")
        delta = tensor.data_ptr() - base.data_ptr()
        if delta % size:
            raise ValueError(f"{what} of two layers are not element-aligned to each other")
        offsets.append(delta // size)
    return base, offsets


def fused_decode_mass(
    queries: Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    scales: Sequence[float | None],
    requests: DecodeRequests,
    layout: KVLayout,
    *,
    k_scales: Sequence[float] | None = None,
    out: torch.Tensor | None = None,
    num_programs: int | None = None,
) -> torch.Tensor:
    """Attention mass of the decode rows, summed over layers and KV heads, in one launch
    (module docstring). ``queries[l]``: layer ``l``'s ``[num_tokens, num_q_heads,
    head_dim]``; ``kv_caches[l]``: its cache of ``layout`` (an affine one: ``bhnc`` or
    ``cpu_attn``; an fp8 cache as its float8 view with ``k_scales``); ``scales[l]``: its
    softmax scale (``None``: ``head_dim ** -0.5``). ``out``: float32 ``[>=
    requests.total_keys]`` to add into (else zeros). The values of the request table are
    not checked (they are on the device)."""
    num_layers = len(queries)
    if not num_layers or not len(kv_caches) == len(scales) == num_layers:
        raise ValueError("need one cache and one scale per layer's queries, at least one layer")
    k_scales = [1.0] * num_layers if k_scales is None else list(k_scales)
    query, query_offsets = _layer_offsets(queries, "queries")
    cache, cache_offsets = _layer_offsets(kv_caches, "KV caches")
    parts = layout.part_strides(cache)
    if parts is None:
        raise ValueError(f"the fused scores kernel does not handle layout {layout.value}")
    layout.check_cache(cache)
    if not cache.dtype.is_floating_point:
        raise ValueError(f"keys of dtype {cache.dtype}: pass an fp8 cache as its float8 view")
    if query.dim() != 3 or query.stride(-1) != 1:
        raise ValueError("queries must be [num_tokens, num_q_heads, head_dim], channels contiguous")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = layout.num_kv_heads(cache)
    if head_dim != layout.head_dim(cache) or num_q_heads % num_kv_heads:
        raise ValueError(
            f"queries {tuple(query.shape)} do not match the cache's {num_kv_heads} KV heads "
            f"of head_dim {layout.head_dim(cache)}"
        )
    device = cache.device
    tables = requests.block_tables
    if query.device != device or tables.device != device or requests.table.device != device:
        raise ValueError("queries, caches and the request table must share a device")
    if tables.stride(-1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if out is None:
        out = torch.zeros(requests.total_keys, dtype=torch.float32, device=device)
    elif out.dtype != torch.float32 or out.numel() < requests.total_keys or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 of >= {requests.total_keys} elements")
    layer_scales = [
        (1.0 / math.sqrt(head_dim) if s is None else float(s)) * float(k)
        for s, k in zip(scales, k_scales, strict=True)
    ]
    from kernels._fused_scores_triton import launch_fused_decode_mass
    from kernels._score_tiles_triton import BLOCK_N, native_dot

    group = num_q_heads // num_kv_heads
    layers, scale_table = _layer_table(query_offsets, cache_offsets, layer_scales, device)
    num_items = num_layers * num_kv_heads * requests.num_requests
    scratch_keys = -(-requests.max_seq_len // BLOCK_N) * BLOCK_N
    per_program = 4 * group * scratch_keys
    programs = num_programs or _default_programs(device, per_program)
    programs = max(1, min(programs, num_items))
    scratch = torch.empty(programs * group * scratch_keys, dtype=torch.float32, device=device)
    keys = parts[0]
    align = vector_alignment(
        [cache],
        [keys.base, keys.block_stride, keys.offset_stride, keys.head_stride, *cache_offsets],
        keys.dim_stride,
    )
    next_item = torch.zeros(1, dtype=torch.int32, device=device)
    args = (
        query, cache, layers, scale_table, tables, requests.table, scratch, out, next_item,
        requests.num_requests, num_items, scratch_keys, tables.stride(0),
        layout.block_size(cache), query.stride(0), query.stride(1), keys.base,
        keys.block_stride, keys.offset_stride, keys.head_stride, keys.dim_stride,
    )  # fmt: skip
    launch_fused_decode_mass(
        programs, args, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        native_dot=native_dot(query, cache), align=align,
    )  # fmt: skip
    return out


_LAYER_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
MAX_LAYER_TABLES = 64


def _layer_table(
    query_offsets: list[int],
    cache_offsets: list[int],
    scales: list[float],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers' offsets (int64 ``[num_layers, 2]``) and scales on the device, uploaded
    once per set: an engine's caches and capture buffer do not move, so a step uploads
    only its request table. A table dropped from the cache is freed in stream order."""
    key = (device, tuple(query_offsets), tuple(cache_offsets), tuple(scales))
    cached = _LAYER_TABLES.get(key)
    if cached is None:
        if len(_LAYER_TABLES) >= MAX_LAYER_TABLES:
            _LAYER_TABLES.clear()
        offsets = np.asarray([query_offsets, cache_offsets], dtype=np.int64).T.copy()
        cached = _LAYER_TABLES[key] = (
            _upload(offsets, device),
            _upload(np.asarray(scales, dtype=np.float32), device),
        )
    return cached


def _default_programs(device: torch.device, per_program_bytes: int) -> int:
    """Enough programs to keep every SM streaming keys, within ``MAX_SCRATCH_BYTES``."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(PROGRAMS_PER_SM * sms, MAX_SCRATCH_BYTES // max(1, per_program_bytes)))
