"""The token table: one request's logical tokens mapped onto physical KV slots.

A request owns a list of blocks; its *local slot* ``p`` lives in block
``block_ids[p // block_size]`` at offset ``p % block_size`` and its *global slot* (what
kernels index) is ``block_id * block_size + offset``::

    logical ids   0  1  2  3  4  5  6  7  8  9      (RoPE position == logical id, forever)
    live          x  .  x  x  .  .  x  x  .  x      (. = evicted)
    local slots  |0  1  2  3 |4  5  6  7 |8  9 . .|  block_size 4, num_slots 10

Invariants (``check_invariants``):
- slots ``[0, num_slots)`` have been written; each holds one logical id; a live logical id
  is held by exactly one slot and ``slot_of(logical)`` points back to it;
- the table holds exactly ``ceil(num_slots / block_size)`` blocks;
- per-token stats arrays are indexed by local slot, so moving a token moves its stats.
"""

from __future__ import annotations

import numpy as np

from kernels.intmath import cdiv


def _grow(array: np.ndarray, size: int, fill: float | int | bool) -> np.ndarray:
    if size <= array.shape[0]:
        return array
    grown = np.full(max(size, 2 * array.shape[0]), fill, dtype=array.dtype)
    grown[: array.shape[0]] = array
    return grown


class TokenTable:
    """Logical -> physical mapping, liveness and per-token stats of one request."""

    def __init__(self, block_size: int, stat_names: tuple[str, ...] = ()) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.block_ids: list[int] = []
        self._logical_at_slot = np.zeros(0, dtype=np.int64)  # [capacity]
        self._live_at_slot = np.zeros(0, dtype=bool)  # [capacity]
        self._slot_of_logical = np.zeros(0, dtype=np.int64)  # [num_logical]; valid if alive
        self._alive = np.zeros(0, dtype=bool)  # [num_logical]
        self.stats: dict[str, np.ndarray] = {
            name: np.zeros(0, dtype=np.float32) for name in stat_names
        }
        self.num_slots = 0
        self.num_logical = 0
        self.num_live = 0

    # ------------------------------------------------------------------ derived counts
    @property
    def num_ideal_blocks(self) -> int:
        """Blocks the live tokens fill when packed: ``ceil(num_live / block_size)``."""
        return cdiv(self.num_live, self.block_size)

    def num_naive_blocks(self, num_new_tokens: int = 0) -> int:
        """Blocks a block-granular manager holds for this request (Naive-Evict): one per
        logical block (``logical_id // block_size``) that holds a live token, counting the
        ``num_new_tokens`` about to be appended."""
        live = self.live_logical_ids() // self.block_size
        new = np.arange(self.num_logical, self.num_logical + num_new_tokens) // self.block_size
        return int(np.unique(np.concatenate([live, new])).size)

    def num_blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks to add before ``append(num_new_tokens)``."""
        end = self.num_slots + num_new_tokens
        return max(0, cdiv(end, self.block_size) - len(self.block_ids))

    # ------------------------------------------------------------------ mutation
    def append(self, num_new_tokens: int, new_block_ids: list[int]) -> np.ndarray:
        """Give the next ``num_new_tokens`` logical ids the next slots; returns their local slots.

        ``new_block_ids`` must hold exactly ``num_blocks_needed(num_new_tokens)`` blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"cannot append {num_new_tokens} tokens")
        if len(new_block_ids) != self.num_blocks_needed(num_new_tokens):
            raise ValueError(
                f"append({num_new_tokens}) needs {self.num_blocks_needed(num_new_tokens)}"
                f" new blocks, got {len(new_block_ids)}"
            )
        first = self.num_slots
        self.block_ids.extend(new_block_ids)
        slots = np.arange(first, first + num_new_tokens, dtype=np.int64)
        logical = np.arange(self.num_logical, self.num_logical + num_new_tokens, dtype=np.int64)
        self._ensure_slot_capacity(first + num_new_tokens)
        self._logical_at_slot[slots] = logical
        self._live_at_slot[slots] = True
        for values in self.stats.values():
            values[slots] = 0.0
        self._slot_of_logical = np.concatenate([self._slot_of_logical, slots])
        self._alive = np.concatenate([self._alive, np.ones(num_new_tokens, dtype=bool)])
        self.num_slots = first + num_new_tokens
        self.num_logical += num_new_tokens
        self.num_live += num_new_tokens
        return slots

    def evict(self, logical_ids: np.ndarray) -> None:
        """Mark live tokens dead. Unknown, repeated or already evicted ids raise ``ValueError``."""
        logical_ids = np.asarray(logical_ids, dtype=np.int64)
        if logical_ids.size == 0:
            return
        if logical_ids.min() < 0 or logical_ids.max() >= self.num_logical:
            raise ValueError(f"logical ids out of range [0, {self.num_logical})")
        if np.unique(logical_ids).size != logical_ids.size:
            raise ValueError("logical ids to evict are repeated")
        if not self._alive[logical_ids].all():
            raise ValueError("some logical ids to evict are already evicted")
        self._alive[logical_ids] = False
        self._live_at_slot[self._slot_of_logical[logical_ids]] = False
        self.num_live -= logical_ids.size

    def move(self, src_slots: np.ndarray, dst_slots: np.ndarray, num_slots: int) -> list[int]:
        """Commit a repack: tokens (and stats) at ``src_slots`` now live at ``dst_slots``.

        ``num_slots`` is the new slot count; every slot at or past it must be dead. The
        blocks past ``ceil(num_slots / block_size)`` leave the table; their ids are
        returned for the caller to free.
        """
        assert not self._live_at_slot[dst_slots].any(), "repack destination is live"
        moved = self._logical_at_slot[src_slots]
        self._logical_at_slot[dst_slots] = moved
        self._live_at_slot[dst_slots] = True
        self._live_at_slot[src_slots] = False
        self._slot_of_logical[moved] = dst_slots
        for values in self.stats.values():
            values[dst_slots] = values[src_slots]
        assert not self._live_at_slot[num_slots : self.num_slots].any(), "live token cut off"
        self.num_slots = num_slots
        num_kept = cdiv(num_slots, self.block_size)
        released = self.block_ids[num_kept:]
        del self.block_ids[num_kept:]
        return released

    def drop_blocks(self, block_indices: np.ndarray, num_slots: int) -> list[int]:
        """Commit a reclaim without copies (block mode): the blocks at ``block_indices``
        (into ``block_ids``) leave the table, and every later slot moves down by the
        dropped blocks' slots (a relabelling: no KV moves, the blocks keep their bytes).
        ``num_slots`` is the new slot count; the kept blocks' slots past it must be dead,
        and so must every slot of a dropped block. Returns the dropped block ids."""
        bs = self.block_size
        dropped = np.zeros(len(self.block_ids), dtype=bool)
        dropped[np.asarray(block_indices, dtype=np.int64)] = True
        slots = np.arange(self.num_slots)
        kept = slots[~dropped[slots // bs]]
        assert not self._live_at_slot[slots[dropped[slots // bs]]].any(), "dropped a live token"
        assert not self._live_at_slot[kept[num_slots:]].any(), "live token cut off"
        kept = kept[:num_slots]
        new_slots = np.arange(num_slots, dtype=np.int64)
        owners = self._logical_at_slot[kept]
        live = self._live_at_slot[kept]
        self._live_at_slot[: self.num_slots] = False
        self._logical_at_slot[new_slots] = owners
        self._live_at_slot[new_slots] = live
        self._slot_of_logical[owners[live]] = new_slots[live]
        for values in self.stats.values():
            values[new_slots] = values[kept]
        released = [self.block_ids[i] for i in np.flatnonzero(dropped)]
        self.block_ids[:] = [b for b, gone in zip(self.block_ids, dropped, strict=True) if not gone]
        self.num_slots = num_slots
        assert len(self.block_ids) == cdiv(num_slots, bs), "blocks != slots after a drop"
        return released

    # ------------------------------------------------------------------ views
    @property
    def live_mask(self) -> np.ndarray:
        """``[num_slots]`` bool: which local slots hold a live token."""
        return self._live_at_slot[: self.num_slots]

    def live_slots(self) -> np.ndarray:
        """Local slots of the live tokens, ascending (the order engines store keys in)."""
        return np.flatnonzero(self.live_mask)

    def live_logical_ids(self) -> np.ndarray:
        """Logical ids of the live tokens in slot order."""
        return self._logical_at_slot[self.live_slots()]

    def slot_of(self, logical_ids: np.ndarray) -> np.ndarray:
        logical_ids = np.asarray(logical_ids, dtype=np.int64)
        if not self._alive[logical_ids].all():
            raise ValueError("evicted tokens own no slot")
        return self._slot_of_logical[logical_ids]

    def is_alive(self, logical_ids: np.ndarray) -> np.ndarray:
        return self._alive[np.asarray(logical_ids, dtype=np.int64)]

    def global_slots(self, local_slots: np.ndarray) -> np.ndarray:
        """Kernel-level slot ids ``block_id * block_size + offset`` of local slots."""
        local_slots = np.asarray(local_slots, dtype=np.int64)
        blocks = np.asarray(self.block_ids, dtype=np.int64)[local_slots // self.block_size]
        return blocks * self.block_size + local_slots % self.block_size

    # ------------------------------------------------------------------ internals
    def _ensure_slot_capacity(self, size: int) -> None:
        self._logical_at_slot = _grow(self._logical_at_slot, size, 0)
        self._live_at_slot = _grow(self._live_at_slot, size, False)
        for name, values in self.stats.items():
            self.stats[name] = _grow(values, size, 0.0)

    def check_invariants(self) -> None:
        live_slots = self.live_slots()
        assert live_slots.size == self.num_live == int(self._alive.sum())
        owners = self._logical_at_slot[live_slots]
        assert np.unique(owners).size == owners.size, "a logical token owns two slots"
        assert (self._slot_of_logical[owners] == live_slots).all(), "slot map out of sync"
        assert self._alive[owners].all()
        assert len(self.block_ids) == cdiv(self.num_slots, self.block_size), "blocks != slots"
