"""Workloads: seeded, Zipf tenants, Poisson arrivals, token ids that share prefixes."""

from __future__ import annotations

from collections import Counter

import pytest

from sim.workloads import WorkloadSpec, generate, system_prompt


def test_the_same_seed_gives_the_same_requests_and_another_does_not():
    spec = WorkloadSpec("chat", rate=5.0, duration_s=30.0, seed=3)
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(WorkloadSpec("chat", 5.0, 30.0, seed=4))


def test_arrivals_are_poisson_at_the_rate():
    requests = generate(WorkloadSpec("sharegpt", rate=20.0, duration_s=200.0))
    assert abs(len(requests) - 4000) < 4 * 4000**0.5  # within 4 standard deviations
    times = [r.arrival_s for r in requests]
    assert times == sorted(times) and times[-1] < 200.0


def test_tenant_shares_follow_zipf():
    requests = generate(WorkloadSpec("sharegpt", rate=50.0, duration_s=100.0, num_tenants=4))
    counts = Counter(r.tenant for r in requests)
    shares = [counts[f"tenant-{k}"] / len(requests) for k in range(4)]
    assert shares == sorted(shares, reverse=True)
    expected = 1 / sum(1 / (k + 1) ** 1.1 for k in range(4))
    assert shares[0] == pytest.approx(expected, abs=0.03)


def test_a_chat_turn_carries_the_history_the_engine_produced():
    spec = WorkloadSpec("chat", rate=5.0, duration_s=60.0)
    requests = generate(spec)
    by_id = {r.request_id: r for r in requests}
    followed = 0
    for request in requests:
        assert request.prompt[: len(system_prompt(spec, int(request.tenant.split("-")[1])))] == (
            system_prompt(spec, int(request.tenant.split("-")[1]))
        )
        previous = by_id.get(request.request_id.rsplit("-u", 1)[0] + f"-u{request.turn - 1}")
        if previous is not None:
            history = previous.prompt + previous.output_tokens
            assert request.prompt[: len(history)] == history
            followed += 1
    assert followed > 10


@pytest.mark.parametrize("kind", ["chat", "long-context", "reasoning", "sharegpt"])
def test_requests_fit_the_model_length(kind):
    spec = WorkloadSpec(kind, rate=5.0, duration_s=30.0, max_model_len=4096)
    for request in generate(spec):
        assert len(request.prompt) + request.max_tokens <= 4096
        assert request.max_tokens >= 1 and request.prompt


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec("batch", 1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        WorkloadSpec("chat", 0.0, 1.0)
