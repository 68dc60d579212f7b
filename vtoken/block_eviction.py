"""Block-granular eviction: the baseline a paged engine ships today (OpenVINO GenAI's
``CacheEvictionConfig``), with any vToken policy's scores.

The policy runs as in token mode (``observe``, ``gate``, ``num_to_evict``, ``score``,
``protected``); its per-token scores are summed per block, and the lowest-scored whole
blocks are dropped (ties: the older block first) until the request has evicted what the
policy asked for (``live <= budget`` for a budget policy), so a request can end up to a
block under its budget. A block that holds a protected token (sinks, a pinned prefix, the
recent window) is kept whole, and so is the last, partially filled block::

    scores     |.1 .1 .2 .1|.9 .8 .7 .9|.0 .1 .0 .1|.5 .6|     block_size 4, budget 8
    sums        0.5         3.3         0.2         1.1          (block 3: the tail)
    dropped                             block 2, then block 0: 14 -> 6 live tokens

Nothing moves: the dropped blocks leave the request's block list
(``vtoken.repack_planner.plan_block_drop``). What a request keeps past its budget is
counted in whole blocks (:func:`num_protected_blocks`).
"""

from __future__ import annotations

import numpy as np

from kernels.intmath import cdiv
from vtoken.policy import EvictionPolicy, PolicyView, Protection


def select_blocks(
    policy: EvictionPolicy,
    view: PolicyView,
    budget: int,
    block_size: int,
    live_slots: np.ndarray,
) -> np.ndarray:
    """The logical ids of every token of the whole blocks ``policy`` drops at ``budget``.

    ``live_slots``: ``[n_live]`` local slots of ``view.logical_ids`` (the token table's
    ``live_slots()``; the block of a token is ``slot // block_size``). Returns sorted int64
    ids, empty when the gate is closed or nothing is due; ``ValueError`` on a negative
    budget. ``view.stats`` is updated by ``observe`` as in :meth:`EvictionPolicy.select`.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    policy.observe(view)
    num_evict = policy.num_to_evict(view, budget) if policy.gate(view) else 0
    if num_evict <= 0 or view.num_live == 0:
        return np.zeros(0, dtype=np.int64)
    blocks = np.asarray(live_slots, dtype=np.int64) // block_size
    num_blocks = int(blocks.max()) + 1
    scores = np.asarray(policy.score(view), dtype=np.float64)
    block_scores = np.bincount(blocks, weights=scores, minlength=num_blocks)
    block_sizes = np.bincount(blocks, minlength=num_blocks)
    kept = block_sizes == 0
    kept[blocks[policy.protected(view, budget)]] = True
    kept[num_blocks - 1] = True  # the last, partially filled block takes the next token
    candidates = np.flatnonzero(~kept)
    order = candidates[np.lexsort((candidates, block_scores[candidates]))]
    evicted = np.cumsum(block_sizes[order])
    num_dropped = min(order.size, int(np.searchsorted(evicted, num_evict)) + 1)
    chosen = np.isin(blocks, order[:num_dropped])
    return np.sort(view.logical_ids[chosen])


def num_protected_blocks(
    protection: Protection, budget: int, num_pinned: int, block_size: int
) -> int:
    """The most blocks block eviction keeps of a request whose policy protects
    ``protection`` at ``budget`` with a pinned prefix of ``num_pinned`` tokens, whatever
    it evicts: the blocks the sinks and pinned prefix cover, ``ceil(sinks / bs)``, and
    those a recent window of ``r`` tokens can straddle, ``ceil(r / bs) + 1`` (the last
    block, kept even without a window, among them). Levels of a gate are summed (an
    upper bound: their regions overlap)."""
    sinks, recent = 0, 0
    level: Protection | None = protection.pinned(num_pinned)
    while level is not None:
        sinks += level.sinks
        recent += level.num_recent(budget)
        level = level.inner
    return cdiv(sinks, block_size) + cdiv(recent, block_size) + 1


def num_protected_block_tokens(
    policy: EvictionPolicy, budget: int, num_pinned: int = 0, *, block_size: int
) -> int:
    """:func:`num_protected_blocks` of ``policy`` in tokens (the squeeze planner's
    ``protected_at`` in block mode: the tokens kept past ``budget``, whole blocks)."""
    blocks = num_protected_blocks(policy.protection(), budget, num_pinned, block_size)
    return blocks * block_size


def admission_protected_tokens(protection: Protection, block_size: int, fraction: float) -> int:
    """The budget-independent part ``P`` of a bound ``P + ceil(fraction * B)`` on the
    tokens block eviction keeps of a request past any budget ``B`` (``fraction``: the
    share of ``B`` its recent windows take, at least ``protection.fraction``), for
    admission: the sinks' blocks, the fixed windows' blocks and the block either end of a
    window straddles, and one block more for the rounding of a budget-sized window.

    Each window of ``r <= recent + ceil(f * B)`` tokens spans at most ``ceil(r / bs) + 1``
    blocks, ``<= (recent + ceil(f * B) + bs - 1) / bs + 1``, so with ``S`` sinks and ``R``
    fixed recent tokens summed over levels it keeps at most ``bs * (ceil(S / bs) +
    ceil(R / bs) + 1) + ceil(f * B) + bs - 1`` tokens."""
    sinks, recent = 0, 0
    level: Protection | None = protection
    while level is not None:
        sinks, recent = sinks + level.sinks, recent + level.recent
        level = level.inner
    blocks = cdiv(sinks, block_size) + cdiv(recent, block_size) + 1
    if fraction > 0:
        blocks += 1
    return blocks * block_size
