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
