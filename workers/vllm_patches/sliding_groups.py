"""The sliding-window KV cache groups of a hybrid engine, kept by vLLM's own managers.

In a hybrid engine (``kv_groups.GroupLayout.hybrid``) vToken's ``allocate_slots`` wrapper
allocates the full-attention group through its token tables and every sliding-window
group through vLLM 0.32's ``SlidingWindowManager`` of that group, exactly as vLLM's
``KVCacheCoordinator`` would: with the request's *logical* counts (a sliding layer keeps
its window whatever the policy evicts from the full-attention layers), freeing the
blocks that left the window before allocating (``remove_skipped_blocks``), adopting a
prefix-cache hit's blocks before any new block is drawn from the shared pool. All groups
draw from one ``BlockPool``; ``held_blocks`` is what the sliding groups hold of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.vllm_patches.kv_groups import GroupLayout


class SlidingGroups:
    """vLLM's managers of ``layout.sliding_groups`` (``coordinator``: vLLM's
    ``KVCacheCoordinator``), driven by vToken's allocation and free hooks."""

    def __init__(self, layout: GroupLayout, coordinator: Any) -> None:
        self.layout = layout
        self.managers = tuple(coordinator.single_type_managers[i] for i in layout.sliding_groups)
        self.null_block = coordinator.block_pool.null_block

    def free_skipped(self, request: Any, num_computed_tokens: int) -> None:
        """Free the blocks that left each window (``num_computed_tokens``: logical, the
        tokens whose KV is written; vLLM does this before it allocates)."""
        for manager in self.managers:
            manager.remove_skipped_blocks(
                request.request_id, num_computed_tokens, request.num_prompt_tokens
            )

    def blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hits: Sequence[Sequence[Any]],
        num_computed_tokens: int,
        admission: bool = False,
    ) -> int:
        """Blocks the sliding groups need to give ``request_id`` slots for ``num_tokens``
        logical tokens (``hits``: each sliding group's prefix-cache hit, in
        ``layout.sliding_groups`` order; ``admission``: the whole sequence's peak, which
        the window bounds)."""
        return sum(
            manager.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                hit,
                num_computed_tokens,
                num_computed_tokens,
                num_tokens,
                apply_admission_cap=admission,
            )
            for manager, hit in zip(self.managers, hits, strict=True)
        )

    def add_hits(
        self, request_id: str, hits: Sequence[Sequence[Any]], num_computed_tokens: int
    ) -> None:
        """Take a not-started request's prefix-cache hit in every sliding group."""
        for manager, hit in zip(self.managers, hits, strict=True):
            manager.add_local_computed_blocks(request_id, hit, num_computed_tokens, 0)

    def allocate(self, request_id: str, num_tokens: int) -> list[list[Any]]:
        """Each sliding group's new blocks for ``num_tokens`` logical tokens (room
        checked by the caller with :meth:`blocks_to_allocate`)."""
        return [
            manager.allocate_new_blocks(request_id, num_tokens, num_tokens)
            for manager in self.managers
        ]

    def free(self, request_id: str) -> None:
        """Finish, abort or preemption (also undoes :meth:`add_hits` of a request that
        got no room: it held nothing else)."""
        for manager in self.managers:
            manager.free(request_id)

    def per_group(self, full: list[Any], sliding: Sequence[list[Any]]) -> tuple[list[Any], ...]:
        """Blocks of every group in vLLM's group order (the full group's at its index)."""
        groups: list[list[Any]] = [[] for _ in range(self.layout.num_groups)]
        groups[self.layout.full_group] = full
        for index, blocks in zip(self.layout.sliding_groups, sliding, strict=True):
            groups[index] = blocks
        return tuple(groups)

    def hits_of(self, hit_blocks: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
        """The sliding groups' part of vLLM's per-group hit (``KVCacheBlocks.blocks``)."""
        if not hit_blocks:
            return [[] for _ in self.managers]
        return [hit_blocks[i] for i in self.layout.sliding_groups]

    def held_block_ids(self, request_id: str | None = None) -> set[int]:
        """Distinct pool blocks the sliding groups hold (for ``request_id``, or all
        requests); a block several requests share through the prefix cache counts once."""
        held: set[int] = set()
        for manager in self.managers:
            lists = (
                [manager.req_to_blocks.get(request_id, [])]
                if request_id is not None
                else manager.req_to_blocks.values()
            )
            for blocks in lists:
                held.update(b.block_id for b in blocks if b is not self.null_block)
        return held

    def held_blocks(self, request_id: str | None = None) -> int:
        """How many :meth:`held_block_ids` there are."""
        return len(self.held_block_ids(request_id))

    def admission_blocks(self, num_tokens: int) -> int:
        """The most blocks a fresh request of ``num_tokens`` tokens holds in the sliding
        groups at once: vLLM's window bound (``max_admission_blocks_per_request``)."""
        return self.blocks_to_allocate("", num_tokens, [[] for _ in self.managers], 0, True)
