"""Selection granularity: one kept set per request, per layer, or per (layer, KV head).

Keys are stored after RoPE and attention is order-free within a request, so each layer and
each KV head may keep *different* tokens in the same physical slots as long as every group
keeps the same count: one block table and one ``seq_len`` still serve all of them::

    granularity   groups          group g is
    request       1               every layer and head alike
    layer         L               layer g, all its KV heads alike
    head          L * Hkv         layer g // Hkv, KV head g % Hkv

A grouped repack moves each group on its own map: a move ``(group, src, dst)`` copies K
and V of that group's layer (and head) only (``GroupedMoves``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

Granularity = Literal["request", "layer", "head"]
GRANULARITIES: tuple[str, ...] = get_args(Granularity)


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What grouping needs of a model: its attention layers and KV heads per layer."""

    num_layers: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_kv_heads < 1:
            raise ValueError(f"a model has >= 1 layer and KV head, got {self}")

    def group_shape(self, granularity: str) -> tuple[int, ...]:
        """``()``, ``(L,)`` or ``(L, Hkv)``: the leading axes of grouped statistics."""
        check_granularity(granularity)
        if granularity == "layer":
            return (self.num_layers,)
        if granularity == "head":
            return (self.num_layers, self.num_kv_heads)
        return ()


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


@dataclass(frozen=True, slots=True)
class GroupedMoves:
    """Per-(layer, KV head) KV moves, int64 arrays of equal length: K and V of head
    ``heads[i]`` of layer ``layers[i]`` go from global slot ``src_slots[i]`` to
    ``dst_slots[i]``. Within one (layer, head) no destination is also a source."""

    layers: np.ndarray
    heads: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray

    @classmethod
    def empty(cls) -> GroupedMoves:
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none, none)

    @classmethod
    def of_groups(
        cls,
        group_ids: np.ndarray,
        src_slots: np.ndarray,
        dst_slots: np.ndarray,
        group_shape: tuple[int, ...],
        num_kv_heads: int,
    ) -> GroupedMoves:
        """Moves of groups of ``group_shape`` ((L,) or (L, Hkv)) as per-head moves: a
        layer's move is repeated for each of its ``num_kv_heads`` heads."""
        group_ids = np.asarray(group_ids, dtype=np.int64)
        if len(group_shape) == 2:
            return cls(group_ids // num_kv_heads, group_ids % num_kv_heads, src_slots, dst_slots)
        assert len(group_shape) == 1, f"no per-head moves for group shape {group_shape}"
        heads = np.tile(np.arange(num_kv_heads, dtype=np.int64), group_ids.size)
        repeat = np.repeat
        return cls(
            repeat(group_ids, num_kv_heads),
            heads,
            repeat(src_slots, num_kv_heads),
            repeat(dst_slots, num_kv_heads),
        )

    @classmethod
    def concatenate(cls, parts: list[GroupedMoves]) -> GroupedMoves:
        if not parts:
            return cls.empty()
        return cls(
            *(
                np.concatenate([getattr(p, name) for p in parts])
                for name in ("layers", "heads", "src_slots", "dst_slots")
            )
        )

    @property
    def num_moves(self) -> int:
        return int(self.src_slots.size)
