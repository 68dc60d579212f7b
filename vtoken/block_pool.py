"""The block-pool interface vToken allocates from, and a standalone pool for tests.

vToken never owns KV memory: it borrows block ids from a pool (vLLM's ``BlockPool``
through an adapter in ``workers/``, or :class:`StandaloneBlockPool` here) and returns
them when a repack empties them.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation; nothing was allocated."""


class BlockPool(Protocol):
    """What vToken needs from a block pool."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_blocks_elsewhere(self) -> int:
        """Blocks of the pool held outside vToken's tables (a hybrid model's
        sliding-window groups, kept by vLLM); 0 where vToken holds every block."""
        ...

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` distinct free block ids, or :class:`NoFreeBlocksError` (nothing taken)."""
        ...

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool; each must currently be allocated."""
        ...


class StandaloneBlockPool:
    """A FIFO free list of ``num_blocks`` block ids.

    Invariant: every id in ``range(num_blocks)`` is either in the free list or allocated,
    never both; the least recently freed block is at the front.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._allocated: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_blocks_elsewhere(self) -> int:
        return 0

    @property
    def num_allocated_blocks(self) -> int:
        return len(self._allocated)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free_block_ids):
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, {len(self._free_block_ids)} free"
            )
        block_ids = [self._free_block_ids.popleft() for _ in range(num_blocks)]
        self._allocated.update(block_ids)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id not in self._allocated:
                raise ValueError(f"block {block_id} is not allocated")
            self._allocated.remove(block_id)
            self._free_block_ids.append(block_id)

    def check_invariants(self) -> None:
        free = set(self._free_block_ids)
        assert len(free) == len(self._free_block_ids), "a block is free twice"
        assert not (free & self._allocated), "a block is both free and allocated"
        assert len(free) + len(self._allocated) == self._num_blocks, "blocks leaked"
