"""A bad ``additional_config`` fails engine start with a clear message."""

from __future__ import annotations

import pytest

from workers.engine import make_llm

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
