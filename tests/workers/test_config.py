"""The plugin's configuration, version check and step messages (no engine)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from vtoken.policy import ScoreNeeds, StepAttention
from vtoken.repack_planner import ReclaimMode
from workers.config import (
    REQUEST_KEY,
    PolicySpec,
    VTokenConfig,
    parse_config,
    request_policy_spec,
)
from workers.messages import StepOps, StepScores
from workers.vllm_patches import UnsupportedVLLMError, check_version
from workers.vllm_patches.support import version_guard


def test_absent_section_means_inert():
    assert parse_config(None) is None
    assert parse_config({}) is None
    assert parse_config({"other_plugin": {"x": 1}}) is None


def test_valid_section():
    config = parse_config({"vtoken": {"policy": "h2o", "keep_ratio": 0.2, "mode": "naive"}})
    assert config == VTokenConfig(policy="h2o", keep_ratio=0.2, mode=ReclaimMode.NAIVE)
    assert config.budget(100) == 20
    assert parse_config({"vtoken": {"policy": "h2o", "budget_tokens": 64}}).budget(1000) == 64
    streaming = {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 60}}
    assert parse_config({"vtoken": streaming}).make_policy().recent == 60


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"policy": "h2o"}, "needs budget_tokens or keep_ratio"),
        ({"policy": "h2o", "keep_ratio": 1.5}, "keep_ratio"),
        ({"policy": "h2o", "keep_ratio": 0.5, "budget_tokens": 8}, "not both"),
        ({"policy": "random", "keep_ratio": 0.5, "policy_args": {"seeed": 1}}, "seeed"),
        ({"policy": "none", "mode": "paged"}, "mode"),
        ({"policy": "none", "score_layers": []}, "score_layers"),
        ({"policy": "none", "unknown_field": 1}, "unknown_field"),
        ("h2o", "must be a dict"),
    ],
)
def test_bad_section_raises_clear_error(section, message):
    with pytest.raises(ValueError, match=message):
        parse_config({"vtoken": section})


def test_request_override_is_read_or_refused_with_a_clear_error():
    assert request_policy_spec(None) is None
    assert request_policy_spec({"tenant": "a"}) is None
    override = {"policy": "h2o", "budget_tokens": 64}
    assert request_policy_spec({REQUEST_KEY: override}) == PolicySpec(**override)
    streaming = {"policy": "streaming_llm", "policy_args": {"recent": 60}}
    assert request_policy_spec({REQUEST_KEY: streaming}).budget(1000) == 1000  # self-limited


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"policy": "h2o", "budget_tokens": 0}, r"budget_tokens: Input should be greater"),
        ({"policy": "h2o"}, "policy 'h2o' needs budget_tokens or keep_ratio"),
        ({"policy": "lru", "keep_ratio": 0.5}, "unknown policy 'lru'"),
        ({"policy": "h2o", "keep_ratio": 0.5, "mode": "naive"}, "mode: Extra inputs"),
        ({"policy": "h2o", "keep_ratio": 0.5, "policy_args": {"sinks": "4"}}, "not supported"),
        ({"policy": "page", "keep_ratio": 0.5, "policy_args": {"inner": "h2o"}}, "per-token"),
        ("h2o", "must be a dict, got str"),
    ],
)
def test_bad_request_override_raises_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message) as error:
        request_policy_spec({REQUEST_KEY: override})
    assert "extra_args['vtoken_policy']" in str(error.value)
    assert "\n" not in str(error.value)  # one line: it becomes an HTTP 400 message


def test_score_layers_checked_against_the_model():
    config = VTokenConfig(score_layers=[0, 5])
    assert config.layer_ids(6) == [0, 5]
    with pytest.raises(ValueError, match="out of range"):
        config.layer_ids(4)


def test_other_vllm_versions_are_refused():
    check_version("0.32.0")
    check_version("0.32.1")
    for version in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(UnsupportedVLLMError, match="vLLM 0.32"):
            check_version(version)


def test_version_guard_blocks_only_vtoken_engines():
    class FakeConfig:
        def __init__(self, additional_config):
            self.additional_config = additional_config

    started = []
    guard = version_guard(UnsupportedVLLMError("wrong vLLM"))(
        lambda self, config: started.append(config)
    )
    guard(None, FakeConfig({}))
    assert len(started) == 1
    with pytest.raises(UnsupportedVLLMError, match="wrong vLLM"):
        guard(None, FakeConfig({"vtoken": {"policy": "none"}}))


def test_step_messages_survive_pickle():
    """They cross to worker processes inside pickled vLLM objects."""
    ops = StepOps(
        src_slots=np.array([70, 71]),
        dst_slots=np.array([3, 4]),
        num_blocks={"a": 2},
        num_evicted={"a": 5},
        score_needs={"a": ScoreNeeds(step_scores=True)},
    )
    back = pickle.loads(pickle.dumps(ops))
    assert back.num_moves == 2 and back.num_blocks == {"a": 2} and back.num_evicted == {"a": 5}
    scores = StepScores({"a": StepAttention(step_scores=np.ones(3, dtype=np.float32))})
    assert pickle.loads(pickle.dumps(scores)).attention["a"].step_scores.tolist() == [1, 1, 1]


def test_messages_ride_vllms_pickled_step_objects():
    """Workers in other processes get the SchedulerOutput pickled (shm broadcast), and the
    driver worker's ModelRunnerOutput comes back pickled: the attributes must survive."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from workers.messages import OPS_ATTRIBUTE, SCORES_ATTRIBUTE

    scheduler_output = SchedulerOutput.make_empty()
    ops = StepOps(src_slots=np.array([9]), dst_slots=np.array([2]), num_evicted={"a": 3})
    setattr(scheduler_output, OPS_ATTRIBUTE, ops)
    back = pickle.loads(pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL))
    assert getattr(back, OPS_ATTRIBUTE).num_evicted == {"a": 3}
    runner_output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    scores = StepScores({"a": StepAttention(step_scores=np.zeros(4, dtype=np.float32))})
    setattr(runner_output, SCORES_ATTRIBUTE, scores)
    back = pickle.loads(pickle.dumps(runner_output, protocol=pickle.HIGHEST_PROTOCOL))
    assert getattr(back, SCORES_ATTRIBUTE).attention["a"].step_scores.shape == (4,)
