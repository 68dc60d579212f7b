"""vToken's ``BlockPool`` protocol over vLLM's ``v1.core.block_pool.BlockPool``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vtoken.block_pool import NoFreeBlocksError


class VLLMBlockPool:
    """vToken's ``BlockPool`` protocol over vLLM's ``v1.core.block_pool.BlockPool``.

    vLLM's null block (id 0) is never handed out, so ``num_blocks`` excludes it.
    ``held_elsewhere`` counts the blocks a hybrid model's sliding-window groups hold
    (``workers/vllm_patches/sliding_groups.py``; ``None``: vToken's tables hold all).
    """

    def __init__(self, block_pool: Any, held_elsewhere: Callable[[], int] | None = None) -> None:
        self.vllm_pool = block_pool
        self.held_elsewhere = held_elsewhere

    @property
    def num_blocks(self) -> int:
        return int(self.vllm_pool.num_gpu_blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return int(self.vllm_pool.get_num_free_blocks())

    @property
    def num_blocks_elsewhere(self) -> int:
        return 0 if self.held_elsewhere is None else self.held_elsewhere()

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        return [block.block_id for block in self.vllm_pool.get_new_blocks(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self.vllm_pool.free_blocks(self.vllm_pool.blocks[i] for i in reversed(block_ids))

    def share(self, blocks: Sequence[Any]) -> None:
        """Take a reference on blocks another request computed (a prefix-cache hit)."""
        self.vllm_pool.touch(blocks)

    def unpublish(self, block_ids: list[int]) -> None:
        """Drop blocks from the prefix cache (their hashes), before their content changes."""
        self.vllm_pool.evict_blocks(set(block_ids))

    def ref_count(self, block_id: int) -> int:
        return int(self.vllm_pool.blocks[block_id].ref_cnt)

    def blocks(self, block_ids: list[int]) -> list[Any]:
        return [self.vllm_pool.blocks[i] for i in block_ids]
