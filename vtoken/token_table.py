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

Grouped tables (``group_shape`` ``(L,)`` or ``(L, Hkv)``, ``vtoken/groups.py``) keep one
map per group: each group holds ``num_live`` tokens, maybe different ones, in the same
slots, so block math is the one above. Every map is ``[num_groups, ...]`` (one row when
ungrouped); the invariants hold per group. A slot is live in the table's shared view
(``live_mask``) when it is live in every group: a hole in any group is a hole there.
"""

from __future__ import annotations

import numpy as np

from kernels.intmath import cdiv


def _grow(array: np.ndarray, size: int, fill: float | int | bool) -> np.ndarray:
    """``[groups, capacity]`` grown to at least ``size`` columns (doubling)."""
    if size <= array.shape[1]:
        return array
    grown = np.full((array.shape[0], max(size, 2 * array.shape[1])), fill, dtype=array.dtype)
    grown[:, : array.shape[1]] = array
    return grown


class TokenTable:
    """Logical -> physical mapping, liveness and per-token stats of one request."""

    def __init__(
        self,
        block_size: int,
        stat_names: tuple[str, ...] = (),
        group_shape: tuple[int, ...] = (),
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.group_shape = tuple(group_shape)
        groups = self.num_groups = int(np.prod(self.group_shape, dtype=np.int64))
        self.block_ids: list[int] = []
        self._logical_at_slot = np.zeros((groups, 0), dtype=np.int64)  # [G, capacity]
        self._live_at_slot = np.zeros((groups, 0), dtype=bool)  # [G, capacity]
        self._slot_of_logical = np.zeros((groups, 0), dtype=np.int64)  # [G, num_logical]
        self._alive = np.zeros((groups, 0), dtype=bool)  # [G, num_logical]
        self.stats: dict[str, np.ndarray] = {  # [G, capacity] each
            name: np.zeros((groups, 0), dtype=np.float32) for name in stat_names
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
        live = np.flatnonzero(self._alive.any(axis=0)) // self.block_size  # in any group
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
        self._logical_at_slot[:, slots] = logical
        self._live_at_slot[:, slots] = True
        for values in self.stats.values():
            values[:, slots] = 0.0
        groups = self.num_groups
        self._slot_of_logical = np.hstack([self._slot_of_logical, np.tile(slots, (groups, 1))])
        self._alive = np.hstack([self._alive, np.ones((groups, num_new_tokens), dtype=bool)])
        self.num_slots = first + num_new_tokens
        self.num_logical += num_new_tokens
        self.num_live += num_new_tokens
        return slots

    def evict(self, logical_ids: np.ndarray) -> None:
        """Mark live tokens dead: ``[k]`` ids in every group, or (grouped) ``[num_groups,
        k]``, the same count in each. Unknown, repeated or already evicted ids, or unequal
        counts, raise ``ValueError``."""
        logical_ids = np.asarray(logical_ids, dtype=np.int64)
        if logical_ids.ndim == 1:
            logical_ids = np.broadcast_to(logical_ids, (self.num_groups, logical_ids.size))
        if logical_ids.ndim != 2 or logical_ids.shape[0] != self.num_groups:
            raise ValueError(
                f"evict takes [k] or [{self.num_groups}, k] ids (equal counts per group),"
                f" got shape {logical_ids.shape}"
            )
        if logical_ids.size == 0:
            return
        if logical_ids.min() < 0 or logical_ids.max() >= self.num_logical:
            raise ValueError(f"logical ids out of range [0, {self.num_logical})")
        if (np.diff(np.sort(logical_ids, axis=1), axis=1) == 0).any():
            raise ValueError("logical ids to evict are repeated")
        rows = np.arange(self.num_groups)[:, None]
        if not self._alive[rows, logical_ids].all():
            raise ValueError("some logical ids to evict are already evicted")
        self._alive[rows, logical_ids] = False
        self._live_at_slot[rows, self._slot_of_logical[rows, logical_ids]] = False
        self.num_live -= logical_ids.shape[1]

    def move(
        self,
        src_slots: np.ndarray,
        dst_slots: np.ndarray,
        num_slots: int,
        group_ids: np.ndarray | None = None,
    ) -> list[int]:
        """Commit a repack: tokens (and stats) at ``src_slots`` now live at ``dst_slots``,
        in group ``group_ids[i]`` (``None``: in every group).

        ``num_slots`` is the new slot count; every slot at or past it must be dead. The
        blocks past ``ceil(num_slots / block_size)`` leave the table; their ids are
        returned for the caller to free.
        """
        if group_ids is None:
            rows = np.arange(self.num_groups)[:, None]
            src, dst = np.asarray(src_slots)[None], np.asarray(dst_slots)[None]
        else:
            rows, src, dst = np.asarray(group_ids, dtype=np.int64), src_slots, dst_slots
        assert not self._live_at_slot[rows, dst].any(), "repack destination is live"
        moved = self._logical_at_slot[rows, src]
        self._logical_at_slot[rows, dst] = moved
        self._live_at_slot[rows, dst] = True
        self._live_at_slot[rows, src] = False
        self._slot_of_logical[rows, moved] = dst
        for values in self.stats.values():
            values[rows, dst] = values[rows, src]
        assert not self._live_at_slot[:, num_slots : self.num_slots].any(), "live token cut off"
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
        and so must every slot of a dropped block. Returns the dropped block ids. Ungrouped
        tables only (block mode keeps one set per request)."""
        if self.num_groups != 1:
            raise ValueError("block mode drops whole blocks of one kept set: ungrouped only")
        bs = self.block_size
        live_at_slot, logical_at_slot = self._live_at_slot[0], self._logical_at_slot[0]
        slot_of_logical = self._slot_of_logical[0]
        dropped = np.zeros(len(self.block_ids), dtype=bool)
        dropped[np.asarray(block_indices, dtype=np.int64)] = True
        slots = np.arange(self.num_slots)
        kept = slots[~dropped[slots // bs]]
        assert not live_at_slot[slots[dropped[slots // bs]]].any(), "dropped a live token"
        assert not live_at_slot[kept[num_slots:]].any(), "live token cut off"
        kept = kept[:num_slots]
        new_slots = np.arange(num_slots, dtype=np.int64)
        owners = logical_at_slot[kept]
        live = live_at_slot[kept]
        live_at_slot[: self.num_slots] = False
        logical_at_slot[new_slots] = owners
        live_at_slot[new_slots] = live
        slot_of_logical[owners[live]] = new_slots[live]
        for values in self.stats.values():
            values[0, new_slots] = values[0, kept]
        released = [self.block_ids[i] for i in np.flatnonzero(dropped)]
        self.block_ids[:] = [b for b, gone in zip(self.block_ids, dropped, strict=True) if not gone]
        self.num_slots = num_slots
        assert len(self.block_ids) == cdiv(num_slots, bs), "blocks != slots after a drop"
        return released

    # ------------------------------------------------------------------ views
    @property
    def live_mask(self) -> np.ndarray:
        """``[num_slots]`` bool: which local slots hold a live token (in every group)."""
        live = self._live_at_slot[:, : self.num_slots]
        return live[0] if self.num_groups == 1 else np.asarray(live.all(axis=0))

    def live_slots(self) -> np.ndarray:
        """Local slots of the live tokens, ascending (the order engines store keys in)."""
        return np.flatnonzero(self.live_mask)

    def live_logical_ids(self) -> np.ndarray:
        """Logical ids of the live tokens in slot order (ungrouped tables; grouped ones:
        ``group_logical_ids``)."""
        if self.num_groups != 1:
            raise ValueError("a grouped table holds a set per group: use group_logical_ids")
        return self._logical_at_slot[0, self.live_slots()]

    def group_live_masks(self) -> np.ndarray:
        """``[num_groups, num_slots]`` bool: each group's live slots."""
        return self._live_at_slot[:, : self.num_slots]

    def group_logical_ids(self) -> np.ndarray:
        """``[num_groups, num_live]``: each group's live logical ids in its slot order."""
        live = self._live_at_slot[:, : self.num_slots]
        return self._logical_at_slot[:, : self.num_slots][live].reshape(self.num_groups, -1)

    def holds_in_place(self, num_tokens: int) -> bool:
        """Whether every group holds logical ids ``0 .. num_tokens - 1`` at those slots (a
        published or pinned prefix, as its hashes say)."""
        n = min(num_tokens, self.num_logical)
        if n > self.num_slots:
            return False
        in_place = np.arange(n)
        live = self._live_at_slot[:, :n].all()
        return bool(live and (self._logical_at_slot[:, :n] == in_place).all())

    def view_logical_ids(self) -> np.ndarray:
        """The live logical ids as a policy sees them: ``[num_live]``, or ``group_shape +
        (num_live,)`` (every group live at the same slots: a repacked table)."""
        if self.num_groups == 1:
            return self.live_logical_ids()
        return self.group_logical_ids().reshape(*self.group_shape, -1)

    def view_stats(self) -> dict[str, np.ndarray]:
        """Writable copies of the stats at the live slots, shaped as ``view_logical_ids``."""
        slots = self._common_live_slots()
        shape = (*self.group_shape, slots.size)
        return {name: values[:, slots].reshape(shape) for name, values in self.stats.items()}

    def store_stats(self, stats: dict[str, np.ndarray]) -> None:
        """Write back stats shaped as ``view_stats`` gave them."""
        slots = self._common_live_slots()
        for name, values in stats.items():
            self.stats[name][:, slots] = np.reshape(values, (self.num_groups, slots.size))

    def slot_of(self, logical_ids: np.ndarray) -> np.ndarray:
        if self.num_groups != 1:
            raise ValueError("a grouped table maps a token to a slot per group")
        logical_ids = np.asarray(logical_ids, dtype=np.int64)
        if not self._alive[0, logical_ids].all():
            raise ValueError("evicted tokens own no slot")
        return self._slot_of_logical[0, logical_ids]

    def is_alive(self, logical_ids: np.ndarray) -> np.ndarray:
        """Liveness of ``logical_ids``: as given, or ``[num_groups, ...]`` when grouped."""
        alive = self._alive[:, np.asarray(logical_ids, dtype=np.int64)]
        return alive[0] if self.num_groups == 1 else alive

    def global_slots(self, local_slots: np.ndarray) -> np.ndarray:
        """Kernel-level slot ids ``block_id * block_size + offset`` of local slots."""
        local_slots = np.asarray(local_slots, dtype=np.int64)
        blocks = np.asarray(self.block_ids, dtype=np.int64)[local_slots // self.block_size]
        return blocks * self.block_size + local_slots % self.block_size

    # ------------------------------------------------------------------ internals
    def _common_live_slots(self) -> np.ndarray:
        slots = self.live_slots()
        assert slots.size == self.num_live, "groups live at different slots: repack first"
        return slots

    def _ensure_slot_capacity(self, size: int) -> None:
        self._logical_at_slot = _grow(self._logical_at_slot, size, 0)
        self._live_at_slot = _grow(self._live_at_slot, size, False)
        for name, values in self.stats.items():
            self.stats[name] = _grow(values, size, 0.0)

    def check_invariants(self) -> None:
        """Per group: ``num_live`` live slots, each owned by one live token that maps back
        to it (so every group holds the same count); blocks cover the slots."""
        for group in range(self.num_groups):
            live_slots = np.flatnonzero(self._live_at_slot[group, : self.num_slots])
            assert live_slots.size == self.num_live == int(self._alive[group].sum())
            owners = self._logical_at_slot[group, live_slots]
            assert np.unique(owners).size == owners.size, "a logical token owns two slots"
            slot_of = self._slot_of_logical[group, owners]
            assert (slot_of == live_slots).all(), "slot map out of sync"
            assert self._alive[group, owners].all()
        assert not self._live_at_slot[:, self.num_slots :].any(), "live slot past the end"
        assert len(self.block_ids) == cdiv(self.num_slots, self.block_size), "blocks != slots"
