"""`vtoken bench repack --granularity`: it times the worker's call (checked moves) and
the unchecked one, and a case whose copy went wrong raises instead of reporting a time."""

from __future__ import annotations

import pytest
import torch

import bench.repack_groups as repack_groups

DIMS = (3, 2, 16)  # layers, KV heads, head size


@pytest.mark.parametrize("granularity", ["request", "layer", "head"])
def test_a_case_times_the_workers_call_and_checks_the_copy(granularity):
    case = repack_groups.granularity_case(
        "tiny", DIMS, 16, "trickle1", granularity, 2, torch.float32
    )
    assert case["moves"] > 0 and case["repack_ms"] > 0
    assert (case["unchecked_ms"] is None) == (granularity == "request")


@pytest.mark.parametrize("granularity", ["request", "head"])
def test_a_copy_that_misses_its_destination_raises(monkeypatch, granularity):
    monkeypatch.setattr(repack_groups, "grouped_repack", lambda *args, **kwargs: None)
    monkeypatch.setattr(repack_groups.kernels, "repack", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="a destination lost its source"):
        repack_groups.granularity_case("tiny", DIMS, 16, "trickle1", granularity, 1, torch.float32)


def test_the_timed_grouped_call_is_the_workers(monkeypatch):
    """The worker calls ``grouped_repack`` with its check on (``workers/worker_side.py``):
    ``repack_ms`` times that call."""
    checks = []
    original = repack_groups.grouped_repack

    def recording(*args, check=True, **kwargs):
        checks.append(check)
        return original(*args, check=check, **kwargs)

    monkeypatch.setattr(repack_groups, "grouped_repack", recording)
    repack_groups.granularity_case("tiny", DIMS, 16, "trickle1", "layer", 2, torch.float32)
    assert checks == [True] * 3 + [False] * 3  # warm + 2 timed, each way
