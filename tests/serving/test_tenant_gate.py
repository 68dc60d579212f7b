"""The throttle answer shared by the pre-check and admission (the gate's Redis paths are
driven end to end in ``test_ingress.py`` and ``test_input_limits.py``)."""

from __future__ import annotations

from serving.tenant_gate import THROTTLE_REASONS, throttled


def test_a_known_reason_is_said_in_words_with_its_retry_after() -> None:
    error = throttled("acme", "kv_budget", 3)
    assert (error.status, error.kind) == (429, "rate_limit")
    assert error.message == "tenant 'acme' is over its KV budget; retry after 3 s"
    assert error.headers == {"Retry-After": "3"}


def test_an_unknown_reason_is_said_as_is() -> None:
    assert "unexplained" not in THROTTLE_REASONS
    error = throttled("acme", "unexplained", 1)
    assert error.message == "tenant 'acme' is unexplained; retry after 1 s"
