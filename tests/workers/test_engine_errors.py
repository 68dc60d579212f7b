"""A bad ``additional_config`` fails engine start with a clear message."""

from __future__ import annotations

import pytest

from workers.engine import make_llm

pytestmark = pytest.mark.slow


def test_bad_config_fails_engine_start(tiny_llama_path):
    with pytest.raises(Exception, match="unknown policy 'nope'"):
        make_llm(tiny_llama_path, {"policy": "nope"}, max_model_len=512, skip_tokenizer_init=True)
