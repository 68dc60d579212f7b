"""Repack on a side CUDA stream, ordered against the compute stream by events.

vToken repacks between two forwards. On a GPU the copies need not hold up the host or the
compute stream's other work: ``SideStreamRepacker.submit`` queues them on a side stream
and returns at once; the compute stream is made to wait for them only where it must.

Invariant (no slot is read or written by two things at once):

1. The copies start after every kernel queued on the compute stream before ``submit``
   (the side stream waits on an event recorded there): the forward that last wrote a
   source slot, or last read a destination slot, has finished with it.
2. Nothing queued on the compute stream after ``fence()`` starts before the copies end:
   the next forward, which reads the destinations and may write into the freed tail
   blocks (given to other requests by the scheduler), is queued after ``fence()``.
   ``fence()`` is a device-side wait (``Stream.wait_event``): the host never blocks.
3. A freed block is reused only by work queued after ``fence()`` (the scheduler frees the
   tail blocks when it plans the repack; the worker calls ``fence()`` before the forward
   that can first write them), so reuse is ordered after the copies that read them.
4. The slots are uploaded on the side stream (from pinned memory, without blocking the
   host), so the caching allocator reuses their memory only after the copies.

Between ``submit`` and ``fence`` the compute stream may run work that touches no moved
slot (input preparation, the embedding), and the host runs on: ``submit`` waits for
nothing on the device. The worker (``workers/worker_side.py``) fences right after it
submits, before the forward's inputs are prepared, so today the copies overlap host work
only. On CPU, ``submit`` copies synchronously and ``fence`` does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.layout import KVLayout
from kernels.repack import check_repack_args, repack
from kernels.slot_checks import slot_problem_numpy


class SideStreamRepacker:
    """``submit`` queues a repack on a side stream; ``fence`` orders the compute stream
    after it. One instance per worker (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._done: torch.cuda.Event | None = None
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # still queued
        self._elapsed_s = 0.0  # of copies that ran, not yet taken
        self.num_submits = 0

    @property
    def pending(self) -> bool:
        """Whether copies were submitted and no ``fence`` has ordered the compute stream yet."""
        return self._done is not None

    def submit(
        self,
        kv_caches: Sequence[torch.Tensor],
        src_slots: np.ndarray,
        dst_slots: np.ndarray,
        layout: KVLayout,
    ) -> None:
        """Queue ``repack(kv_caches, src_slots, dst_slots, layout)`` behind the compute
        stream's queued work, without blocking the host or that stream. The slots (int64
        host arrays) are checked here, on the host: a check on the device would wait."""
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} sources but {len(dst_slots)} destinations")
        if len(src_slots) == 0:
            return
        num_slots = layout.num_blocks(kv_caches[0]) * layout.block_size(kv_caches[0])
        problem = slot_problem_numpy(src_slots, dst_slots, num_slots)
        if problem is not None:
            raise ValueError(problem.message(num_slots))
        self.num_submits += 1
        moves = np.stack(
            [np.asarray(src_slots, dtype=np.int64), np.asarray(dst_slots, dtype=np.int64)]
        )
        if self._stream is None:
            src, dst = torch.from_numpy(moves)
            check_repack_args(kv_caches, src, dst, layout, slot_values=False)
            repack(kv_caches, src, dst, layout, check=False)
            return
        # Pinned, so the upload is asynchronous: a copy from pageable memory would wait for
        # the compute stream. The caching host allocator keeps the pinned block until the
        # copy that reads it has run.
        staged = torch.from_numpy(moves).pin_memory()
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # (1): after the forward that wrote the sources
        self._collect_timings()
        with torch.cuda.stream(self._stream):
            src, dst = staged.to(self.device, non_blocking=True)
            check_repack_args(kv_caches, src, dst, layout, slot_values=False)
            # Timed from here: the copies (and the gaps between their launches), not the
            # host's checks above nor the upload.
            started = torch.cuda.Event(enable_timing=True)
            started.record(self._stream)
            repack(kv_caches, src, dst, layout, check=False)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self._stream)
        self._done = done  # (4): src and dst were allocated on the side stream
        self._timed.append((started, done))

    def fence(self) -> None:
        """Make the compute stream wait (on the device) for every submitted copy."""
        if self._done is None:
            return
        torch.cuda.current_stream(self.device).wait_event(self._done)  # (2), (3)
        self._done = None

    def take_elapsed_s(self) -> float:
        """Device seconds of the submitted copies that have run since the last call
        (between two events on the side stream around the copy kernels; a first call of a
        Triton kernel includes its compilation). Never blocks: copies still queued are
        counted by a later call."""
        self._collect_timings()
        elapsed, self._elapsed_s = self._elapsed_s, 0.0
        return elapsed

    def _collect_timings(self) -> None:
        """Move the timings of copies that have run out of the queue (so it holds only
        copies in flight, however rarely the times are taken)."""
        while self._timed and self._timed[0][1].query():
            started, done = self._timed.pop(0)
            self._elapsed_s += started.elapsed_time(done) / 1000.0

    def synchronize(self) -> None:
        """Block the host until every submitted copy ran (tests, shutdown)."""
        if self._stream is not None:
            self._stream.synchronize()
