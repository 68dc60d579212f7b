"""Block mode inside vLLM (SmolLM2-135M): whole blocks dropped from the middle of a
request's block row, nothing copied, outputs equal to the reference engine.

One prompt runs under each policy on a ``block`` engine and on a ``naive`` engine (token
decisions, held as a block-granular manager must). The block engine must finish every
request, move no token, hold fewer blocks at the end than the naive engine, and equal
``workers/hf_sim.py`` replaying its evictions (transformers, evicted tokens removed from
its cache, positions logical); its decisions must equal the reference engine's own block
decisions under the same policy.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from bench.fragmentation import natural_prompts
from policies import make_policy
from vtoken import ReclaimMode, StandaloneBlockPool, VTokenManager
from vtoken.policy import EvictionPolicy, PolicyView
from workers.engine import engine_state, internal_request_id, make_llm
from workers.hf_sim import HFSimEngine

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
NUM_NEW_TOKENS = 16
CONFIGS: dict[str, dict] = {
    "h2o": {"policy": "h2o", "keep_ratio": 0.5},
    "random": {"policy": "random", "policy_args": {"sinks": 4}, "keep_ratio": 0.5},
}
POLICIES = sorted(CONFIGS)


@dataclass
class Replay(EvictionPolicy):
    """Evicts, at each step, the ids a recorded run evicted at that step."""

    steps: list[np.ndarray] = field(default_factory=list)

    def select(self, view: PolicyView, budget: int) -> np.ndarray:
        return self.steps[view.step - 1]


@dataclass(frozen=True, slots=True)
class Run:
    """One engine's greedy tokens, evictions and final held blocks per policy."""

    token_ids: dict[str, list[int]]
    evictions: dict[str, list[np.ndarray]]
    held_blocks: dict[str, int]
    repack_moves_total: int


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return HFSimEngine(str(smollm2_path))


@pytest.fixture(scope="module")
def prompt(reference):
    return natural_prompts(reference.tokenizer, 1, 320)[0]


def run_engine(model: str, mode: str, prompt: list[int]) -> Run:
    """One engine of ``mode`` serving the prompt once per policy (each request carries its
    policy in ``extra_args["vtoken_policy"]``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vtoken = {"policy": "none", "mode": mode, "record_evictions": True, "check_invariants": True}
    llm = make_llm(model, vtoken, block_size=BLOCK_SIZE, max_model_len=1024)
    params = [
        SamplingParams(
            max_tokens=NUM_NEW_TOKENS,
            temperature=0,
            ignore_eos=True,
            extra_args={"vtoken_policy": CONFIGS[name]},
        )
        for name in POLICIES
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * len(POLICIES), params)
    state = engine_state(llm)
    assert state is not None
    finished = {
        name: state.finished[internal_request_id(state, o.request_id)]
        for name, o in zip(POLICIES, outputs, strict=True)
    }
    run = Run(
        token_ids={n: list(o.outputs[0].token_ids) for n, o in zip(POLICIES, outputs, strict=True)},
        evictions={name: record.evictions for name, record in finished.items()},
        held_blocks={name: record.report.allocated_blocks for name, record in finished.items()},
        repack_moves_total=state.snapshot().repack_moves_total,
    )
    del llm
    gc.collect()  # the next engine may start only after this one shut down
    return run


@pytest.fixture(scope="module")
def runs(smollm2_path, prompt):
    return run_engine(str(smollm2_path), "block", prompt), run_engine(
        str(smollm2_path), "naive", prompt
    )


def test_block_mode_drops_whole_blocks_without_copies_and_holds_fewer_than_naive(runs):
    block, naive = runs
    assert block.repack_moves_total == 0
    for name in POLICIES:
        assert len(block.token_ids[name]) == NUM_NEW_TOKENS
        dropped = np.concatenate(block.evictions[name])
        assert dropped.size > 0, "the policy never evicted: test is vacuous"
        # Whole blocks of logical ids, from the middle of the row (the tail is kept).
        _, counts = np.unique(dropped // BLOCK_SIZE, return_counts=True)
        assert (counts == BLOCK_SIZE).all(), name
        assert block.held_blocks[name] < naive.held_blocks[name], name


@pytest.mark.parametrize("name", POLICIES)
def test_block_mode_equals_reference_on_the_same_evictions(runs, reference, prompt, name):
    block, _ = runs
    manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
    replay = Replay(steps=block.evictions[name])
    result = reference.generate(prompt, NUM_NEW_TOKENS, replay, lambda n: n, [manager])
    assert result.token_ids == block.token_ids[name]


@pytest.mark.parametrize("name", POLICIES)
def test_block_mode_decisions_equal_reference_block_decisions(runs, reference, prompt, name):
    block, _ = runs
    config = CONFIGS[name]
    manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE, ReclaimMode.BLOCK)
    policy = make_policy(name, **config.get("policy_args", {}))
    keep = config["keep_ratio"]
    result = reference.generate(
        prompt, NUM_NEW_TOKENS, policy, lambda n: math.ceil(keep * n), [manager]
    )
    for step, (ours, theirs) in enumerate(zip(block.evictions[name], result.evicted, strict=True)):
        assert np.array_equal(ours, theirs), f"{name} step {step}"
