"""Serve application wiring that needs no Ray: what admission learns of the engines."""

from __future__ import annotations

import pytest

from serving.app import policy_keep_ratio


@pytest.mark.parametrize(
    ("vtoken", "expected"),
    [
        ({"policy": "h2o", "keep_ratio": 0.5}, 0.5),
        ({"policy": "h2o", "keep_ratio": 0.2, "eviction": "on_demand"}, 0.2),
        ({"policy": "none"}, None),  # never evicts: requests hold prompt + max_tokens
        ({"policy": "snapkv", "keep_ratio": 0.2}, None),  # compresses once, not every step
        ({"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 60}}, None),
        ({"policy": "h2o", "budget_tokens": 256}, None),  # an absolute budget, no ratio
    ],
)
def test_admission_learns_the_engines_keep_ratio_only_when_the_policy_evicts_to_it(
    vtoken, expected
):
    assert policy_keep_ratio(vtoken) == expected
