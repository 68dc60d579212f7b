"""Whether moves are a valid repack of slots ``[0, num_slots)``, and what is wrong if not.

Valid: every slot in range, no destination twice, none also a source (sources are read
while destinations are written). Sources may repeat. Three checkers give the same verdict:
numpy (CPU slots, no per-op dispatch), torch (device slots), and the C loop's own
(``kernels/csrc/repack.c: check_moves``, which reports a problem by its ``SlotProblem``
value through ``vtoken_repack_status_name``).
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
import torch


class SlotProblem(StrEnum):
    """The first problem found, in this order. Values are the C loop's status names."""

    OUT_OF_RANGE = "out_of_range"
    DST_TWICE = "dst_twice"
    DST_ALSO_SOURCE = "dst_also_source"

    def message(self, num_slots: int) -> str:
        """The ``ValueError`` message for moves over ``num_slots`` slots."""
        return {
            SlotProblem.OUT_OF_RANGE: f"slots out of range [0, {num_slots})",
            SlotProblem.DST_TWICE: "a destination slot appears twice",
            SlotProblem.DST_ALSO_SOURCE: "a destination slot is also a source: moves would race",
        }[self]


def slot_problem_torch(src: torch.Tensor, dst: torch.Tensor, num_slots: int) -> SlotProblem | None:
    """The problem of moves ``src -> dst`` (1-D int64 on one device); ``None`` if valid."""
    both = torch.cat([src, dst])
    if int(both.min()) < 0 or int(both.max()) >= num_slots:
        return SlotProblem.OUT_OF_RANGE
    if torch.unique(dst).numel() != dst.numel():
        return SlotProblem.DST_TWICE
    if bool(torch.isin(dst, src).any()):
        return SlotProblem.DST_ALSO_SOURCE
    return None


def slot_problem_numpy(src: np.ndarray, dst: np.ndarray, num_slots: int) -> SlotProblem | None:
    """The same checks on non-empty int64 arrays, without torch's per-op dispatch."""
    if min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_slots:
        return SlotProblem.OUT_OF_RANGE
    ordered = np.sort(dst)
    if bool((ordered[1:] == ordered[:-1]).any()):
        return SlotProblem.DST_TWICE
    found = np.minimum(np.searchsorted(ordered, src), ordered.size - 1)
    if bool((ordered[found] == src).any()):
        return SlotProblem.DST_ALSO_SOURCE
    return None
