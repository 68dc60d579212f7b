"""The plugin's configuration, version check and step messages (no engine)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from controlplane.admission import kv_bounds
from kernels.intmath import cdiv
from policies import CAP_POLICY, REGISTRY
from vtoken.block_eviction import select_blocks
from vtoken.groups import ModelGeometry
from vtoken.policy import PolicyView, ScoreNeeds, StepAttention
from vtoken.repack_planner import ReclaimMode
from workers.config import (
    NOTHING_FREED,
    REQUEST_KEY,
    PolicySpec,
    ProtectionBound,
    VTokenConfig,
    parse_config,
    request_policy_spec,
    spread_layers,
)
from workers.messages import StepOps, StepScores
from workers.vllm_patches import UnsupportedVLLMError, check_version
from workers.vllm_patches.support import (
    UnsupportedEngineError,
    grouping_geometry,
    grouping_problems,
    model_is_hybrid,
    refuse_grouped_request,
    version_guard,
)


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
        ({"policy": "none", "score_layers": 0}, "score_layers"),
        ({"policy": "none", "score_layers": True}, "score_layers"),
        ({"policy": "none", "score_layers": "4"}, "score_layers must be 'all', a count"),
        ({"policy": "none", "score_layers": ["1"]}, "score_layers"),
        ({"policy": "none", "unknown_field": 1}, "unknown_field"),
        ({"policy": "tova", "keep_ratio": 0.5, "policy_args": {"granularity": "x"}}, "granul"),
        ({"policy": "random", "keep_ratio": 0.5, "policy_args": {"granularity": "head"}}, "at gr"),
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


@pytest.mark.parametrize(
    ("count", "num_layers", "expected"),
    [
        (4, 30, [0, 10, 19, 29]),
        (16, 30, [0, 2, 4, 6, 8, 10, 12, 14, 15, 17, 19, 21, 23, 25, 27, 29]),
        (1, 30, [29]),
        (2, 30, [0, 29]),
        (3, 7, [0, 3, 6]),
        (8, 6, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_a_count_of_score_layers_spreads_them_ending_with_the_last(count, num_layers, expected):
    assert VTokenConfig(score_layers=count).layer_ids(num_layers) == expected
    ids = spread_layers(count, num_layers)
    assert ids == sorted(set(ids)) and ids[-1] == num_layers - 1
    assert len(ids) == min(count, num_layers)
    assert count == 1 or ids[0] == 0  # spread over the whole depth, not packed at the top


@pytest.mark.parametrize(
    ("vtoken", "expected"),
    [
        ({"policy": "h2o", "keep_ratio": 0.5}, 0.5),
        ({"policy": "h2o", "keep_ratio": 0.2, "eviction": "on_demand"}, 0.2),
        ({"policy": "none"}, None),  # never evicts: requests hold prompt + max_tokens
        ({"policy": "snapkv", "keep_ratio": 0.2}, None),  # compresses once, not every step
        ({"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 60}}, None),
        ({"policy": "h2o", "budget_tokens": 256}, None),  # an absolute budget, no ratio
        ({"policy": "h2o", "keep_ratio": 0.2, "mode": "naive"}, None),  # frees no block
        # 64 sinks are kept whatever the ratio: admission adds them (admission_protection)
        ({"policy": "random", "policy_args": {"sinks": 64}, "keep_ratio": 0.1}, 0.1),
        ({"policy": "h2o", "keep_ratio": 0.2, "policy_args": {"recent_fraction": 0.5}}, 0.2),
    ],
)
def test_admission_learns_the_engines_keep_ratio_only_when_the_policy_evicts_to_it(
    vtoken, expected
):
    assert VTokenConfig.model_validate(vtoken).admission_keep_ratio() == expected


@pytest.mark.parametrize(
    ("vtoken", "expected"),
    [
        ({"policy": "h2o", "keep_ratio": 0.5}, (0, 0.5)),  # H2O's recent half of its budget
        ({"policy": "h2o", "keep_ratio": 0.5, "prefix_pin_tokens": 512}, (512, 0.5)),
        (
            {
                "policy": "h2o",
                "keep_ratio": 0.5,
                "policy_args": {"sinks": 4},
                "prefix_pin_tokens": 2,
            },
            (4, 0.5),
        ),
        (  # under a tenant's cap a request may run under the cap policy (H2O): its recent half
            {"policy": "random", "keep_ratio": 0.1, "policy_args": {"sinks": 4, "recent": 60}},
            (64, 0.5),
        ),
        ({"policy": "page", "keep_ratio": 0.2, "policy_args": {"sinks": 3, "recent": 5}}, (8, 0.5)),
        ({"policy": "none", "prefix_pin_tokens": 64}, (64, 0.5)),
        ({"policy": "scissorhands", "keep_ratio": 0.3, "prefix_pin_tokens": 8}, (8, 0.5)),
    ],
)
def test_admission_learns_what_the_policy_keeps_past_any_budget(vtoken, expected):
    tokens, fraction = expected
    protection = VTokenConfig.model_validate(vtoken).admission_protection()
    assert protection == ProtectionBound(tokens=tokens, fraction=fraction)


def test_admission_knows_the_chunk_only_where_budgeted_requests_evict_during_prefill():
    """The chunk reaches admission when every request it counts with a budget evicts
    during prefill: under the engine's policy (its keep ratio), or under the cap policy
    where the engine's policy does not hold a budget (SnapKV, PAGE: their keep ratio is
    not counted, a capped request runs under H2O). Not in naive mode (eviction frees no
    block), nor when the chunk is unknown."""
    h2o = VTokenConfig(policy="h2o", keep_ratio=0.2)
    assert h2o.admission_prefill_chunk_tokens(64) == 64
    assert h2o.admission_prefill_chunk_tokens(None) is None
    naive = VTokenConfig(policy="h2o", keep_ratio=0.2, mode="naive")
    assert naive.admission_prefill_chunk_tokens(64) is None
    for policy in ("snapkv", "page"):
        config = VTokenConfig(policy=policy, keep_ratio=0.2)
        assert config.admission_keep_ratio() is None
        assert config.admission_prefill_chunk_tokens(64) == 64


def test_in_naive_mode_a_capped_request_counts_its_whole_length():
    """Naive-Evict frees no block by evicting, so a tenant's cap lowers nothing."""
    config = VTokenConfig(policy="h2o", keep_ratio=0.2, mode=ReclaimMode.NAIVE)
    protection = config.admission_protection()
    assert protection == NOTHING_FREED
    bounds = kv_bounds(
        40, 24, 4, 12, protected_tokens=protection.tokens, protected_fraction=protection.fraction
    )
    assert bounds.steady == kv_bounds(40, 24, 4, None).steady == 16


def test_the_floor_admission_counts_squeezing_tenants_at_is_what_the_policy_always_keeps():
    """The budget that covers its own protection: H2O keeps sinks (or a pinned prefix)
    plus half its budget as a recent window, so a budget under twice the sinks is not
    what the request keeps."""

    def floor(**vtoken):
        return VTokenConfig.model_validate(vtoken).admission_floor_tokens()

    assert floor(policy="h2o", keep_ratio=0.2) == 0
    assert floor(policy="h2o", keep_ratio=0.2, policy_args={"sinks": 4}) == 8
    assert floor(policy="h2o", keep_ratio=0.2, prefix_pin_tokens=20) == 40
    assert floor(policy="none") is None  # never evicts
    assert floor(policy="h2o", keep_ratio=0.2, mode="naive") is None


PROTECTING = {"sinks": 3, "recent": 5, "recent_fraction": 0.25}


@pytest.mark.parametrize("prefix_pin_tokens", [0, 12])
@pytest.mark.parametrize(
    "policy_args",
    [
        *({"name": name, **PROTECTING} for name in sorted(REGISTRY)),
        {"name": "page", "inner": "streaming_llm", **PROTECTING},  # + its policy's 4 sinks
    ],
    ids=[*sorted(REGISTRY), "page-around-streaming_llm"],
)
def test_admission_counts_at_least_what_the_policy_protects_at_every_budget(
    policy_args, prefix_pin_tokens
):
    """One source: the steady bound ``kv_bounds`` computes from the engine's
    ``admission_protection`` never counts fewer tokens than ``protection()`` keeps at a
    budget ``B`` (the engine's exact count, its pinned prefix as sinks), under the
    engine's policy and under the cap policy a capped request may run under instead."""
    args = dict(policy_args)
    config = VTokenConfig(
        policy=args.pop("name"),
        policy_args=args,
        keep_ratio=0.2,
        prefix_pin_tokens=prefix_pin_tokens,
    )
    bound = config.admission_protection()
    kept_by_engine = [
        config.make_policy().protection().pinned(prefix_pin_tokens),
        CAP_POLICY().protection().pinned(prefix_pin_tokens),
    ]
    prompt, max_tokens, block_size = 10_000, 10_000, 1  # in tokens: no block rounding
    for budget in range(1, 400):
        steady = kv_bounds(
            prompt,
            max_tokens,
            block_size,
            budget,
            protected_tokens=bound.tokens,
            protected_fraction=bound.fraction,
        ).steady
        counted = steady - 1  # kv_bounds adds a block (size 1) for the step's new token
        for protection in kept_by_engine:
            assert counted >= max(budget, protection.num_protected(budget)), (budget, protection)
    assert bound.tokens == kept_by_engine[0].tokens  # the same sinks, pinned prefix, windows


@pytest.mark.parametrize("prefix_pin_tokens", [0, 12])
@pytest.mark.parametrize("name", ["random", "h2o", "streaming_llm"])
def test_block_mode_admission_counts_every_block_block_eviction_keeps(name, prefix_pin_tokens):
    """In block mode each protected token pins its whole block: the steady bound counts
    at least the blocks ``select_blocks`` keeps at every budget and length, under the
    engine's policy and under the cap policy (H2O) a capped request may run under."""
    block_size = 16  # a few protected tokens pin far more in whole blocks
    config = VTokenConfig(
        policy=name,
        policy_args={"sinks": 1, "recent": 2, "recent_fraction": 0.1},
        keep_ratio=0.2,
        prefix_pin_tokens=prefix_pin_tokens,
        mode="block",
    )
    bound = config.admission_protection(block_size)
    rng = np.random.default_rng(0)
    for length in range(1, 400, 7):
        for budget in range(1, length + 1, 5):
            for policy in (config.make_policy(), CAP_POLICY()):
                view = PolicyView(
                    logical_ids=np.arange(length),
                    num_logical=length,
                    prompt_len=length,
                    step=1,
                    stats={n: np.zeros(length, np.float32) for n in policy.stat_names},
                    attention=StepAttention(step_scores=rng.random(length)),
                    num_pinned=prefix_pin_tokens,
                )
                evicted = select_blocks(policy, view, budget, block_size, np.arange(length))
                kept_blocks = cdiv(length - evicted.size, block_size)
                steady = kv_bounds(
                    length,
                    0,
                    block_size,
                    budget,
                    protected_tokens=bound.tokens,
                    protected_fraction=bound.fraction,
                ).steady
                assert steady - 1 >= kept_blocks or steady == cdiv(length, block_size)


def test_block_mode_admission_needs_the_block_size():
    config = VTokenConfig(policy="h2o", keep_ratio=0.2, mode="block")
    with pytest.raises(ValueError, match="block_size"):
        config.admission_protection()
    assert config.admission_keep_ratio() == 0.2
    # H2O's recent half of its budget (no sinks, no fixed window): the block its window
    # straddles and the rounding of a budget-sized window, on top of ceil(0.5 x B).
    assert config.admission_protection(16) == ProtectionBound(tokens=2 * 16, fraction=0.5)
    assert config.admission_floor_tokens(16) == 64


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


def _vllm_config(device: str = "cpu", tensor_parallel: int = 1) -> SimpleNamespace:
    """The fields ``grouping_geometry`` reads of a vLLM config (30 layers, 3 KV heads)."""
    model = SimpleNamespace(get_num_layers=lambda _: 30, get_num_kv_heads=lambda _: 3)
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel),
        device_config=SimpleNamespace(device_type=device),
    )


def test_granularity_is_a_policy_arg_and_refused_where_grouped_repacks_cannot_run():
    head = {"policy": "snapkv", "keep_ratio": 0.5, "policy_args": {"granularity": "head"}}
    config = parse_config({"vtoken": head})
    assert config.make_policy().granularity == "head"
    assert grouping_geometry(_vllm_config(), config) == ModelGeometry(30, 3)
    for vllm_config, settings, message in [
        (_vllm_config("cuda"), {}, "CUDA engine"),
        (_vllm_config(tensor_parallel=2), {}, "tensor parallelism"),
        (_vllm_config(), {"score_layers": 4}, "score_layers"),
        (_vllm_config(), {"mode": "block"}, "block mode"),
    ]:
        refused = parse_config({"vtoken": {**head, **settings}})
        with pytest.raises(UnsupportedEngineError, match=message):
            grouping_geometry(vllm_config, refused)
        one_set = parse_config({"vtoken": {**head, "policy_args": {}, **settings}})
        assert grouping_geometry(vllm_config, one_set) is None  # one set: runs as before


def test_grouping_problems_name_every_setting_and_refuse_grouped_overrides_only():
    engine = parse_config({"vtoken": {"policy": "tova", "keep_ratio": 0.5}})
    assert grouping_problems(_vllm_config(), engine) == []
    refused = parse_config({"vtoken": {"policy": "tova", "keep_ratio": 0.5, "score_layers": 4}})
    problems = grouping_problems(_vllm_config("cuda", 2), refused, hybrid=True)
    assert len(problems) == 4
    for name in ("CUDA engine", "tensor parallelism", "score_layers", "sliding-window"):
        assert any(name in problem for problem in problems), name
    assert grouping_problems(_vllm_config(), refused.model_copy(update={"mode": "block"}))[-1:] == [
        "block mode (whole blocks of one set)"
    ]
    head = request_policy_spec(
        {REQUEST_KEY: {"policy": "h2o", "budget_tokens": 8, "policy_args": {"granularity": "head"}}}
    )
    one_set = request_policy_spec({REQUEST_KEY: {"policy": "h2o", "budget_tokens": 8}})
    assert head is not None and one_set is not None
    with pytest.raises(ValueError, match="granularity 'head', which this engine cannot run: a"):
        refuse_grouped_request(head, problems)
    refuse_grouped_request(head, [])  # the engine can group: the override stands
    refuse_grouped_request(one_set, problems)  # one set per request runs anywhere
    hybrid = SimpleNamespace(hf_text_config=SimpleNamespace(layer_types=["sliding_attention"]))
    assert model_is_hybrid(hybrid) and not model_is_hybrid(
        SimpleNamespace(hf_text_config=SimpleNamespace())
    )
