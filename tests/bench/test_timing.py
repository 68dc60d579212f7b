"""The kernel benchmarks' timing (``bench/timing.py``)."""

from __future__ import annotations

from bench.timing import device_only_times


def test_device_only_times_drop_samples_whose_launch_was_not_hidden() -> None:
    times = {
        "repack_device": 0.2,
        "repack_launch_hidden": 1.0,
        "copy_device": 0.5,
        "copy_launch_hidden": 0.0,  # the host waited: the figure holds host time
    }
    assert device_only_times(times, ("repack", "copy", "scores")) == {
        "repack": 0.2,
        "copy": None,
        "scores": None,
    }
