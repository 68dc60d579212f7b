"""The exact replica: vLLM's scheduler with vToken's patches and a fake executor."""

from __future__ import annotations

import pytest

from sim.attention import SyntheticAttention
from sim.model_configs import model_folder
from sim.replica import ExactReplica, ReplicaConfig
from tests.sim.conftest import token_prompts


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> str:
    return model_folder("llama-3.1-8b", tmp_path_factory.mktemp("models"))


def drain(replica: ExactReplica) -> list:
    records = []
    while (record := replica.step()) is not None:
        records.append(record)
    return records


def test_chunked_prefill_then_one_token_per_step(llama8b):
    config = ReplicaConfig(llama8b, None, num_blocks=512, block_size=16, max_model_len=8192,
                           max_num_batched_tokens=1024)  # fmt: skip
    replica = ExactReplica(config)
    replica.add_request("a", token_prompts(1, 3000)[0], 5)
    records = drain(replica)
    assert [r.prefill_tokens for r in records[:3]] == [1024, 1024, 952]
    assert [r.decode_tokens for r in records[3:7]] == [1, 1, 1, 1]
    assert records[2].first_tokens == ("a",)  # the step that completes the prompt samples
    assert records[6].finished == ("a",)
    assert records[6].num_output_tokens == {"a": 5}
    # As in EngineCore: one empty step tells the workers the request finished.
    assert [r.num_requests for r in records[7:]] == [0]


def test_the_prefix_cache_serves_a_repeated_prompt(llama8b):
    config = ReplicaConfig(llama8b, None, num_blocks=256, block_size=16, max_model_len=4096,
                           enable_prefix_caching=True)  # fmt: skip
    replica = ExactReplica(config)
    prompt = token_prompts(1, 1000)[0]
    replica.add_request("first", prompt, 4, output_tokens=[5, 6, 7, 8])
    drain(replica)
    replica.add_request("second", [*prompt, 5, 6, 7, 8, 9], 2)
    records = drain(replica)
    # Whole blocks of the first prompt and its output: 1004 tokens -> 62 blocks of 16.
    assert records[0].cached_tokens == {"second": 62 * 16}
    assert records[0].prefill_tokens == 1005 - 62 * 16


def test_vanilla_preempts_where_on_demand_evicts(llama8b):
    counts = {}
    for name, vtoken in [
        ("vanilla", None),
        ("on_demand", {"policy": "h2o", "keep_ratio": 0.3, "eviction": "on_demand",
                       "squeeze_below_budget": True}),
    ]:  # fmt: skip
        config = ReplicaConfig(llama8b, vtoken, num_blocks=40, block_size=16, max_model_len=1024)
        replica = ExactReplica(config, SyntheticAttention(num_layers=32, num_heads=32))
        for index, prompt in enumerate(token_prompts(8, 100)):
            replica.add_request(str(index), prompt, 100)
        finished = sum(len(r.finished) for r in drain(replica))
        assert finished == 8
        state = replica.state
        counts[name] = (replica.num_preemptions, state and state.num_evictions_under_pressure)
        if state is not None:
            state.check_invariants()
    assert counts["vanilla"][0] > 0
    assert counts["on_demand"][0] < counts["vanilla"][0] and counts["on_demand"][1] > 0


def test_eager_keeps_live_tokens_at_the_budget(llama8b):
    vtoken = {"policy": "streaming_llm", "keep_ratio": 0.25, "eviction": "eager"}
    config = ReplicaConfig(llama8b, vtoken, num_blocks=256, block_size=16, max_model_len=2048)
    replica = ExactReplica(config)
    replica.add_request("a", token_prompts(1, 400)[0], 200)
    records = drain(replica)
    last = records[-2]  # the last step that ran the request
    assert last.context_tokens == 599  # logical: the prompt and every output but the last
    assert last.live_tokens <= 0.25 * 600 + 16
    assert sum(r.num_moves for r in records) > 0  # the repack moved tokens


def test_bad_requests_are_refused(llama8b):
    replica = ExactReplica(ReplicaConfig(llama8b, None, num_blocks=64, max_model_len=512))
    with pytest.raises(ValueError, match="exceed"):
        replica.add_request("a", [1] * 500, 100)
    with pytest.raises(ValueError, match="empty"):
        replica.add_request("b", [], 10)
    with pytest.raises(ValueError, match="config.json"):
        ExactReplica(ReplicaConfig("/nonexistent", None, num_blocks=64))
