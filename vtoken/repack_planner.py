"""The repack planner: which tokens move where, and which blocks are freed.

vtoken mode, for a request with ``n_live`` live tokens::

    before   |x . x x|. . x x|. x . .|      n_live = 6, block_size 4
    holes below n_live: slots 1, 4, 5       sources at/after n_live: slots 6, 7, 9
    moves    6 -> 1, 7 -> 4, 9 -> 5          (moves == holes below n_live <= all holes)
    after    |x x x x|x x . .|              ceil(6 / 4) = 2 blocks kept, block 2 freed

Holes are paired with sources in ascending order, so runs of consecutive holes receive
runs of consecutive sources (contiguous copies for the kernels). A grouped table (one kept
set per layer or per (layer, KV head), ``vtoken/groups.py``) plans the same per group:
each group compacts its own survivors into slots ``[0, n_live)``, and a move names its
group (``group_ids``). ``vtoken`` and ``naive``
plan the same repack; they differ in what the manager holds besides (``vtoken/manager.py``).

block mode (block-granular eviction, ``vtoken/block_eviction.py``) moves nothing: whole
dead blocks leave the request's block list and later slots shift down by whole blocks::

    before   |x x x x|. . . .|x x . .|      block 1 dead, dead tail slot 10..11
    after    |x x x x|x x|                  no moves, block 1 freed, 6 slots
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from kernels.intmath import cdiv
from vtoken.token_table import TokenTable


class ReclaimMode(StrEnum):
    VTOKEN = "vtoken"  # hold the fewest blocks the repacked live tokens fit in
    NAIVE = "naive"  # Naive-Evict: hold every logical block that still has a live token
    BLOCK = "block"  # block-granular eviction: whole blocks dropped, nothing moved


@dataclass(frozen=True, slots=True)
class RepackPlan:
    """Moves and frees for one request. Slots are int64 arrays of equal length.

    ``src_local``/``dst_local`` index the request's own slots (the token table);
    ``src_slots``/``dst_slots`` are the global slots the kernels copy. ``group_ids``: the
    group each move belongs to (grouped tables), ``None`` when every move copies a whole
    slot (every layer and head).
    """

    src_local: np.ndarray
    dst_local: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray
    num_slots_after: int
    free_block_indices: np.ndarray  # into the table's block_ids
    free_block_ids: list[int]
    group_ids: np.ndarray | None = None

    @property
    def num_moves(self) -> int:
        return int(self.src_local.size)

    @property
    def touches_blocks(self) -> bool:
        """Whether an engine must act: copy KV or cut freed blocks from its block table.
        A plan that only drops dead tail tokens changes ``num_slots_after`` and nothing
        else; committing it (``TokenTable.move``) is all it takes."""
        return self.num_moves > 0 or bool(self.free_block_ids)


def plan_repack(table: TokenTable) -> RepackPlan:
    """Plan the repack of ``table`` (pure: the table is not changed)."""
    num_live = table.num_live
    group_ids = None
    if table.num_groups == 1:
        live = table.live_mask
        dst_local = np.flatnonzero(~live[:num_live])
        src_local = np.flatnonzero(live[num_live:]) + num_live
    else:  # row-major: each group's holes and sources in ascending order, equal counts
        live = table.group_live_masks()
        group_ids, dst_local = np.nonzero(~live[:, :num_live])
        src_groups, src_local = np.nonzero(live[:, num_live:])
        assert np.array_equal(group_ids, src_groups), "groups hold unequal counts"
        src_local = src_local + num_live
    assert src_local.size == dst_local.size
    num_blocks_kept = cdiv(num_live, table.block_size)
    free_indices = np.arange(num_blocks_kept, len(table.block_ids), dtype=np.int64)
    return RepackPlan(
        src_local=src_local,
        dst_local=dst_local,
        src_slots=table.global_slots(src_local),
        dst_slots=table.global_slots(dst_local),
        num_slots_after=num_live,
        free_block_indices=free_indices,
        free_block_ids=[table.block_ids[int(i)] for i in free_indices],
        group_ids=group_ids,
    )


def plan_block_drop(table: TokenTable) -> RepackPlan:
    """Plan a reclaim without copies (block mode; pure): free every block that holds no
    live token, and cut dead slots at the end. ``ValueError`` when a dead token sits in a
    block that keeps a live one before the last live token (only a repack could free it:
    block mode evicts whole blocks, ``vtoken.block_eviction.select_blocks``)."""
    live = table.live_mask
    live_slots = np.flatnonzero(live)
    end = int(live_slots[-1]) + 1 if live_slots.size else 0
    num_blocks = len(table.block_ids)
    live_per_block = np.bincount(live_slots // table.block_size, minlength=num_blocks)
    free_indices = np.flatnonzero(live_per_block == 0).astype(np.int64)
    slots = np.arange(end)
    kept = slots[live_per_block[slots // table.block_size] > 0]
    if not live[kept].all():
        raise ValueError(
            "block mode drops whole blocks only: a dead token shares a block with live ones"
        )
    empty = np.zeros(0, dtype=np.int64)
    return RepackPlan(
        src_local=empty,
        dst_local=empty,
        src_slots=empty,
        dst_slots=empty,
        num_slots_after=int(kept.size),
        free_block_indices=free_indices,
        free_block_ids=[table.block_ids[int(i)] for i in free_indices],
    )
