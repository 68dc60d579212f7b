"""The three slot checkers (numpy, torch, the C loop's) agree, message for message."""

from __future__ import annotations

import numpy as np
import torch

from kernels.layout import KVLayout
from kernels.repack_cpu import cpu_repack, load_library
from kernels.slot_checks import SlotProblem, slot_problem_numpy, slot_problem_torch


def test_slot_checks_agree_on_cpu_and_device_paths() -> None:
    """Sources may repeat, destinations may not, and none may be both: numpy (CPU slots),
    torch (device slots) and the C loop give the same verdict."""
    layout, block_size = KVLayout.CPU_ATTN, 8
    cache = layout.new_cache(5, block_size, 1, 32)  # 40 slots
    parts = layout.part_strides(cache)
    assert parts is not None
    rng = np.random.default_rng(0)
    verdicts: set[SlotProblem | None] = set()
    for trial in range(400):
        size = int(rng.integers(1, 6 if trial < 200 else 30))  # then: hash-set collisions
        src, dst = rng.integers(-1, 41, size), rng.integers(0, 41, size)
        src_slots, dst_slots = torch.from_numpy(src), torch.from_numpy(dst)
        by_numpy = slot_problem_numpy(src, dst, 40)
        assert by_numpy == slot_problem_torch(src_slots, dst_slots, 40)
        verdicts.add(by_numpy)
        if load_library() is None:
            continue
        try:
            cpu_repack([cache], src_slots, dst_slots, parts, block_size, 1, 32, num_slots=40)
            by_c = None
        except ValueError as error:
            by_c = str(error)
        assert by_c == (by_numpy.message(40) if by_numpy else None), (src, dst)
    assert verdicts == {*SlotProblem, None}


def test_messages_name_the_problem() -> None:
    assert SlotProblem.OUT_OF_RANGE.message(7) == "slots out of range [0, 7)"
    assert "twice" in SlotProblem.DST_TWICE.message(7)
    assert "also a source" in SlotProblem.DST_ALSO_SOURCE.message(7)
