"""What crosses between vLLM's scheduler (engine core) and its workers each step.

Both ride on objects vLLM already ships across that boundary: ``StepOps`` as the
attribute ``vtoken_ops`` of the ``SchedulerOutput`` (broadcast to the workers, pickled
when they are other processes), ``StepScores`` as the attribute ``vtoken_scores`` of the
``ModelRunnerOutput`` (returned by the driver worker). Plain dataclasses of numpy arrays:
picklable, no vLLM or torch types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vtoken.groups import GroupedMoves
from vtoken.policy import ScoreNeeds, StepAttention

OPS_ATTRIBUTE = "vtoken_ops"
SCORES_ATTRIBUTE = "vtoken_scores"


@dataclass(frozen=True, slots=True)
class StepOps:
    """Scheduler -> worker, applied before the step's forward, in this order.

    1. ``repack``: copy KV ``src_slots[i] -> dst_slots[i]`` (global slots, int64) in every
       layer. These are the moves of repacks the scheduler committed after the previous
       step; the blocks they empty may already be allocated to requests of this step,
       whose forward writes them only after the copies (same stream / synchronous CPU).
       ``grouped``: the moves of requests whose policy keeps a set per layer or per
       (layer, KV head): K and V of one layer's head each (``vtoken/groups.py``).
    2. ``num_blocks``: truncate these requests' block lists to this length (tail blocks the
       repack emptied), before this step's ``new_block_ids`` are appended. ``block_rows``
       (block mode: blocks dropped from the middle, nothing copied): replace these
       requests' block lists with these block ids (int32), before them too.
    3. ``num_evicted``: per scheduled vToken request, logical minus physical token count.
       Positions stay logical; ``seq_lens`` and the slot mapping subtract this.
    4. ``score_needs``: the statistics each scored request's policy needs this step.
    """

    src_slots: np.ndarray
    dst_slots: np.ndarray
    num_blocks: dict[str, int] = field(default_factory=dict)
    block_rows: dict[str, np.ndarray] = field(default_factory=dict)
    num_evicted: dict[str, int] = field(default_factory=dict)
    score_needs: dict[str, ScoreNeeds] = field(default_factory=dict)
    grouped: GroupedMoves = field(default_factory=GroupedMoves.empty)

    @property
    def num_moves(self) -> int:
        """Whole-slot moves (every layer and head); ``grouped`` counts its own."""
        return int(self.src_slots.size)


@dataclass(frozen=True, slots=True)
class StepScores:
    """Worker -> scheduler: attention statistics of the step, per request, aligned with the
    request's physical slots ``[0, seq_len)`` (== its token table's live slots), and what
    the worker's repacks have cost since it started.

    The repack totals are cumulative, so an output vLLM drops (an empty step) loses
    nothing: the scheduler keeps the latest. ``repack_bytes_total`` counts bytes read (the
    same are written) over every distinct layer cache of the driver rank (in tensor
    parallelism every rank moves its own shard alike); ``repack_seconds_total`` is the
    copies' own time: wall time of the synchronous copy on CPU, device time between CUDA
    events on the side stream on GPUs (counted once the copies have run, so it can trail
    the bytes by a step)."""

    attention: dict[str, StepAttention]
    repack_bytes_total: int = 0
    repack_seconds_total: float = 0.0
