"""Step timing reported by the scheduler side (pure logic, an injected clock)."""

from __future__ import annotations

import pytest

from workers.step_times import StepTimes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_the_longest_step_of_the_window() -> None:
    clock = Clock()
    steps = StepTimes(clock, wall=lambda: clock.now + 1000, window_s=2.0)
    assert steps.recent_max_s() == 0.0
    for duration, gap in ((0.2, 0.0), (0.7, 0.1), (0.3, 0.1)):
        clock.now += gap
        steps.begin()
        clock.now += duration
        steps.end()
    assert steps.recent_max_s() == pytest.approx(0.7)
    # The longest two, in time order, stamped with the wall clock at their end.
    (first, second) = steps.recent_longest(2)
    assert first == (pytest.approx(1101.0), pytest.approx(0.7))
    assert second == (pytest.approx(1101.4), pytest.approx(0.3))
    clock.now += 1.5  # the 0.7 s step ended 1.9 s ago: still in the window
    assert steps.recent_max_s() == pytest.approx(0.7)
    clock.now += 0.2  # now 2.1 s ago: forgotten; the 0.3 s step ended 1.7 s ago
    assert steps.recent_max_s() == pytest.approx(0.3)
    clock.now += 5
    assert steps.recent_max_s() == 0.0


def test_an_output_without_a_scheduled_step_is_not_a_step() -> None:
    clock = Clock()
    steps = StepTimes(clock)
    steps.end()  # e.g. an output for a step scheduled before vToken saw it
    assert steps.recent_max_s() == 0.0
    steps.begin()
    clock.now += 0.4
    steps.end()
    steps.end()  # a second output for the same step adds nothing
    assert steps.recent_max_s() == pytest.approx(0.4)
