"""The repack planner: which tokens move where, and which blocks are freed.

vtoken mode, for a request with ``n_live`` live tokens::

    before   |x . x x|. . x x|. x . .|      n_live = 6, block_size 4
    holes below n_live: slots 1, 4, 5       sources at/after n_live: slots 6, 7, 9
    moves    6 -> 1, 7 -> 4, 9 -> 5          (moves == holes below n_live <= all holes)
    after    |x x x x|x x . .|              ceil(6 / 4) = 2 blocks kept, block 2 freed

Holes are paired with sources in ascending order, so runs of consecutive holes receive
runs of consecutive sources (contiguous copies for the kernels). Both reclaim modes plan
the same repack; they differ in what the manager holds besides (``vtoken/manager.py``).
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


@dataclass(frozen=True, slots=True)
class RepackPlan:
    """Moves and frees for one request. Slots are int64 arrays of equal length.

    ``src_local``/``dst_local`` index the request's own slots (the token table);
    ``src_slots``/``dst_slots`` are the global slots the kernels copy.
    """

    src_local: np.ndarray
    dst_local: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray
    num_slots_after: int
    free_block_indices: np.ndarray  # into the table's block_ids
    free_block_ids: list[int]

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
    live = table.live_mask
    dst_local = np.flatnonzero(~live[:num_live])
    src_local = np.flatnonzero(live[num_live:]) + num_live
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
    )
