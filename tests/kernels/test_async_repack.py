"""The side-stream repacker: same bytes as the synchronous repack, host-side checks, and
(on CUDA) the compute stream ordered after the copies without the host waiting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.async_repack import SideStreamRepacker
from kernels.layout import KVLayout, paged_layer_views
from kernels.repack import reference_repack
from tests.kernels.conftest import DEVICE

LAYOUT = KVLayout.BHNC


def _caches() -> list[torch.Tensor]:
    caches = paged_layer_views(4, 64, 16, 4, 64, torch.bfloat16, DEVICE, "LBNHC")
    whole = caches[0].untyped_storage().nbytes() // 2
    caches[0].as_strided((whole,), (1,), 0).normal_()
    return caches


def test_submit_then_fence_moves_the_reference_bytes() -> None:
    caches = _caches()
    rng = np.random.default_rng(0)
    perm = rng.permutation(64 * 16)
    src, dst = perm[:300], perm[300:600]
    expected = [c.clone() for c in caches]
    reference_repack(
        expected, torch.from_numpy(src).to(DEVICE), torch.from_numpy(dst).to(DEVICE), LAYOUT
    )
    repacker = SideStreamRepacker(DEVICE)
    repacker.submit(caches, src, dst, LAYOUT)
    assert repacker.pending == (DEVICE.type == "cuda")
    repacker.fence()
    assert not repacker.pending
    # Work queued after the fence sees the moved bytes.
    after = [c.clone() for c in caches]
    assert all(torch.equal(a, e) for a, e in zip(after, expected, strict=True))


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([1, 2], [3], "sources but"),
        ([1, 2], [2, 5], "also a source"),
        ([1], [10**6], "out of range"),
    ],
)
def test_bad_moves_are_refused_on_the_host(src: list[int], dst: list[int], message: str) -> None:
    caches = _caches()
    before = [c.clone() for c in caches]
    repacker = SideStreamRepacker(DEVICE)
    with pytest.raises(ValueError, match=message):
        repacker.submit(caches, np.array(src), np.array(dst), LAYOUT)
    assert not repacker.pending and repacker.num_submits == 0
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))


def test_empty_moves_queue_nothing() -> None:
    repacker = SideStreamRepacker(DEVICE)
    repacker.submit(_caches(), np.zeros(0, np.int64), np.zeros(0, np.int64), LAYOUT)
    assert not repacker.pending and repacker.num_submits == 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="stream ordering needs CUDA")
def test_copies_wait_for_queued_compute_and_fence_orders_the_next() -> None:
    """The compute stream sleeps, then writes a source slot: the copy (submitted while it
    sleeps, without the host waiting) must carry the written value, and a read queued
    after ``fence`` must see it at the destination. Without the side stream's wait on the
    compute stream the copy would run during the sleep and move the old value."""
    caches = _caches()
    keys, _ = LAYOUT.keys_values(caches[0])
    keys[0, 5].fill_(0)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning on the compute stream
    keys[0, 5, 0, 0] = 3.0  # queued after the sleep, before submit
    repacker = SideStreamRepacker(DEVICE)
    repacker.submit(caches, np.array([5, 6, 7]), np.array([900, 901, 902]), LAYOUT)
    assert repacker.pending
    repacker.fence()
    moved = keys[900 // 16, 900 % 16, 0, 0].clone()  # queued after the fence
    torch.cuda.synchronize()
    assert float(moved) == 3.0
    # The copies' time is counted once they have run; the sleep before them is not theirs
    # (the kernels were compiled by the tests above).
    elapsed = repacker.take_elapsed_s()
    assert 0.0 < elapsed < 0.1
    assert repacker.take_elapsed_s() == 0.0  # each submit is counted once
