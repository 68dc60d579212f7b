"""A bad ``additional_config`` fails engine start with a clear message."""

from __future__ import annotations

import pytest

from tests.workers.conftest import token_prompts
from workers.engine import engine_state, make_llm

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("vtoken", "message"),
    [
        ({"policy": "nope"}, "unknown policy 'nope'"),
        (
            {"policy": "h2o", "keep_ratio": 0.5, "score_layers": [0, 7]},
            r"score_layers \[7\] out of range",
        ),
    ],
)
def test_bad_config_fails_engine_start(tiny_llama_path, vtoken, message):
    with pytest.raises(Exception, match=message):
        make_llm(tiny_llama_path, vtoken, max_model_len=512, skip_tokenizer_init=True)


def test_bad_request_override_is_refused_and_the_engine_serves_on(tiny_llama_path):
    """A bad ``extra_args["vtoken_policy"]`` is refused for that request alone: the front end
    raises a client error before the request exists, the engine core refuses one that
    skipped the front end, and a request already running finishes under its own budget."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMValidationError

    llm = make_llm(
        tiny_llama_path,
        {"policy": "h2o", "keep_ratio": 0.5},
        max_model_len=512,
        skip_tokenizer_init=True,
    )
    engine = llm.llm_engine
    running, refused = (TokensPrompt(prompt_token_ids=ids) for ids in token_prompts([60, 40]))

    def params(override):
        extra = {"vtoken_policy": override}
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, extra_args=extra)

    engine.add_request("running", running, params({"policy": "h2o", "budget_tokens": 16}))
    engine.step()
    with pytest.raises(VLLMValidationError, match="budget_tokens: Input should be greater"):
        engine.add_request("refused", refused, params({"policy": "h2o", "budget_tokens": 0}))
    skipped_front_end = engine.input_processor.process_inputs(
        "pre-built",
        refused,
        params({"policy": "tova", "budget_tokens": 8}),
        supported_tasks=engine.get_supported_tasks(),
    )
    skipped_front_end.sampling_params.extra_args["vtoken_policy"] = {"policy": "lru"}
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        engine.engine_core.engine_core.preprocess_add_request(skipped_front_end)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs] == [("running", 6)]
    (finished,) = engine_state(llm).finished.values()
    counters = finished.report
    assert counters.live_tokens <= 16 < 60  # ran under its own cap, not the engine's ratio


def test_a_grouped_override_is_refused_where_the_engine_keeps_one_set(tiny_llama_path):
    """An engine that cannot keep a set per layer or head (here: one layer of two scored)
    refuses a request asking for one, at the front end (a client error naming why) and
    in the engine core; one that got past both is finished with an error by the
    scheduler side, and the request after it runs."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.request import Request

    llm = make_llm(
        tiny_llama_path,
        {"policy": "tova", "keep_ratio": 0.5, "score_layers": 1},
        max_model_len=512,
        skip_tokenizer_init=True,
    )
    engine, core = llm.llm_engine, llm.llm_engine.engine_core.engine_core
    grouped, plain = (TokensPrompt(prompt_token_ids=ids) for ids in token_prompts([40, 30]))
    override = {"policy": "tova", "keep_ratio": 0.5, "policy_args": {"granularity": "head"}}

    def params(extra):
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, extra_args=extra)

    why = "granularity 'head', which this engine cannot run: score_layers other than every"
    with pytest.raises(VLLMValidationError, match=why):
        engine.add_request("grouped", grouped, params({"vtoken_policy": override}))
    pre_built = engine.input_processor.process_inputs(
        "pre-built", grouped, params({}), supported_tasks=engine.get_supported_tasks()
    )
    pre_built.sampling_params.extra_args["vtoken_policy"] = override
    with pytest.raises(ValueError, match=why):
        core.preprocess_add_request(pre_built)
    core.scheduler.add_request(Request.from_engine_core_request(pre_built, None))
    engine.add_request("plain", plain, params(None))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs] == [("plain", 6)]
    assert not core.scheduler.requests and not engine_state(llm).refused
