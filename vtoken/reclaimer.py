"""The reclaimer: applies repack plans to the KV cache and returns emptied blocks.

Order per batch of plans: (1) copy the moved tokens of every layer in one kernel launch
(on CUDA, on a side stream that first waits for the compute stream, so the copies see the
last forward's writes), (2) commit the token tables, (3) free the emptied blocks only once
the copies that read or write them have completed. On CPU the copy is synchronous, so
blocks are freed at once; on CUDA an event per batch guards them, and
``before_forward`` makes the compute stream wait for copies still in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import kernels
from kernels import KVLayout
from vtoken.block_pool import BlockPool
from vtoken.repack_planner import RepackPlan
from vtoken.token_table import TokenTable


class Reclaimer:
    """Copies, commits and frees; ``kv_caches`` may be empty for accounting-only use."""

    def __init__(
        self,
        pool: BlockPool,
        kv_caches: Sequence[torch.Tensor] = (),
        layout: KVLayout = KVLayout.CPU_ATTN,
    ) -> None:
        self.pool = pool
        self.kv_caches = list(kv_caches)
        self.layout = layout
        on_cuda = bool(self.kv_caches) and self.kv_caches[0].is_cuda
        self._stream = torch.cuda.Stream(self.kv_caches[0].device) if on_cuda else None
        self._pending: list[tuple[torch.cuda.Event, list[int]]] = []
        self._last_copy: torch.cuda.Event | None = None  # orders the next forward after it
        self.num_moves = 0
        self.num_blocks_freed = 0

    def apply(self, batch: Sequence[tuple[TokenTable, RepackPlan]]) -> None:
        """Apply the plans of several requests (one copy launch for all of them)."""
        event = self._copy(batch)
        released: list[int] = []
        for table, plan in batch:
            table.move(plan.src_local, plan.dst_local, plan.num_slots_after)
            released += table.drop_blocks(plan.free_block_indices)
            self.num_moves += plan.num_moves
        self.release(released, event)

    def release(self, block_ids: list[int], event: torch.cuda.Event | None = None) -> None:
        """Free blocks once the copies touching them completed (at once without copies)."""
        if not block_ids:
            return
        if event is None and self._pending:
            event = self._pending[-1][0]  # in-flight copies may still touch these blocks
        if event is None:
            self.pool.free(block_ids)
            self.num_blocks_freed += len(block_ids)
        else:
            self._pending.append((event, block_ids))

    def poll(self) -> int:
        """Free the blocks whose copies completed; returns how many were freed."""
        freed = 0
        while self._pending and self._pending[0][0].query():
            _, block_ids = self._pending.pop(0)
            self.pool.free(block_ids)
            freed += len(block_ids)
        self.num_blocks_freed += freed
        return freed

    def wait(self) -> int:
        """Block until every copy completed, then free everything pending."""
        for event, _ in self._pending:
            event.synchronize()
        return self.poll()

    def before_forward(self) -> None:
        """Make the compute stream wait for in-flight copies before it reads the cache.

        The engine must call this before every forward on CUDA (copies on one stream
        complete in order, so waiting for the last one covers all)."""
        if self._last_copy is not None:
            torch.cuda.current_stream().wait_event(self._last_copy)
            self._last_copy = None

    @property
    def num_pending_blocks(self) -> int:
        return sum(len(block_ids) for _, block_ids in self._pending)

    def _copy(self, batch: Sequence[tuple[TokenTable, RepackPlan]]) -> torch.cuda.Event | None:
        moving = [plan for _, plan in batch if plan.num_moves]
        if not moving or not self.kv_caches:
            return None
        device = self.kv_caches[0].device
        src = torch.from_numpy(np.concatenate([p.src_slots for p in moving])).to(device)
        dst = torch.from_numpy(np.concatenate([p.dst_slots for p in moving])).to(device)
        if self._stream is None:
            kernels.repack(self.kv_caches, src, dst, self.layout)
            return None
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            kernels.repack(self.kv_caches, src, dst, self.layout)
            event = torch.cuda.Event()
            event.record(self._stream)
        # The index tensors were made on the compute stream and are read on the side stream.
        src.record_stream(self._stream)
        dst.record_stream(self._stream)
        self._last_copy = event
        return event
