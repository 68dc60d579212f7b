"""Attention sources: replay refuses a run that diverged; ids match vLLM's front end."""

from __future__ import annotations

import numpy as np
import pytest

from sim.attention import ReplayedAttention, external_id
from vtoken.policy import ScoreNeeds, StepAttention


def test_replay_refuses_a_diverged_run():
    replay = ReplayedAttention([{"0": StepAttention(step_scores=np.ones(40, np.float32))}])
    needs = ScoreNeeds(step_scores=True)
    assert replay.statistics("0", None, needs, 40, 1, 0).step_scores.size == 40  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="live tokens"):
        replay.statistics("0", None, needs, 41, 1, 0)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no recorded"):
        replay.statistics("1", None, needs, 40, 1, 0)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no recorded"):
        replay.statistics("0", None, needs, 40, 1, 1)  # type: ignore[arg-type]


def test_external_ids_drop_vllms_suffix_only():
    assert external_id("12-a1b2c3d4") == "12"
    assert external_id("c7-0f0f0f0f") == "c7"
    assert external_id("t0-s3-u1") == "t0-s3-u1"
