"""The serving benchmark: its workloads and goodput search as pure logic, and a quick run
on SmolLM2 through real vLLM engines (JSON structure and vanilla's attainment when idle)."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from bench.serve import (
    ATTAINMENT,
    ENGINES,
    Session,
    Trial,
    Turn,
    chat_workload,
    ratios,
    search_goodput,
    single_workload,
    truncated_pareto,
)

CORPUS = list(range(100, 20_100))


def test_truncated_pareto_stays_in_range_and_is_long_tailed():
    rng = random.Random(0)
    lengths = sorted(truncated_pareto(rng, 128, 2048, 1.2) for _ in range(4000))
    assert lengths[0] >= 128 and lengths[-1] <= 2048
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert 200 < median < 400  # most prompts are short ...
    assert p99 > 1500  # ... and a few are very long


def test_workloads_are_seeded_and_respect_their_bounds():
    first = single_workload(CORPUS, 30, (128, 2048), (32, 256), seed=3)
    assert first == single_workload(CORPUS, 30, (128, 2048), (32, 256), seed=3)
    assert first != single_workload(CORPUS, 30, (128, 2048), (32, 256), seed=4)
    starts = [s.start for s in first.sessions]
    assert starts == sorted(starts) and first.num_requests == 30
    for session in first.sessions:
        (turn,) = session.turns
        assert 128 <= len(turn.user) <= 2048 and 32 <= turn.max_tokens <= 256
    chat = chat_workload(CORPUS, 10, (2, 6), (32, 256), (32, 256), 1024, 1.0, seed=3)
    assert chat.max_len <= 1024
    assert sum(len(s.turns) >= 2 for s in chat.sessions) >= 5
    session = chat.sessions[0]
    # the prompt of a later turn carries every earlier prompt and answer
    assert session.context_len(1) == (
        len(session.turns[0].user) + session.turns[0].max_tokens + len(session.turns[1].user)
    )


def test_context_len_of_a_first_turn_is_its_prompt():
    session = Session(0.0, (Turn((1, 2, 3), 5), Turn((4,), 2)))
    assert session.context_len(0) == 3 and session.context_len(1) == 3 + 5 + 1


def _threshold_trials(capacity: float):
    """Trials that pass below ``capacity`` requests per second (a monotone engine)."""
    seen = []

    def trial_at(rate: float) -> Trial:
        seen.append(rate)
        met = 10 if rate <= capacity else 5
        return Trial(rate=rate, met=met, missed=10 - met, total=10)

    return trial_at, seen


def test_goodput_is_bisected_between_the_last_pass_and_the_first_failure():
    trial_at, seen = _threshold_trials(1.3)
    goodput, bound, trials = search_goodput(trial_at, [0.5, 1.0, 2.0, 4.0], bisect_steps=3)
    assert bound == "bisected" and 1.0 <= goodput <= 1.3
    assert seen[:4] == [0.5, 1.0, 2.0, 4.0] and all(1.0 < r < 2.0 for r in seen[4:])
    assert len(trials) == 7


def test_goodput_bounds_when_every_rate_passes_or_none_does():
    trial_at, _ = _threshold_trials(10.0)
    assert search_goodput(trial_at, [0.5, 1.0], 2)[:2] == (1.0, "at_least")
    trial_at, _ = _threshold_trials(0.1)
    assert search_goodput(trial_at, [0.5, 1.0], 2)[:2] == (0.0, "below_lowest")


def test_a_stopped_trial_reports_an_upper_bound_on_attainment():
    trial = Trial(rate=1.0, met=3, missed=2, total=10, stopped_early=True)
    assert trial.attainment == pytest.approx(0.8) and not trial.passed
    assert Trial(rate=1.0, met=9, missed=1, total=10).attainment == pytest.approx(ATTAINMENT)


def test_ratios_pair_each_vtoken_row_with_naive_and_vanilla():
    rows = [
        {
            "engine": "vanilla",
            "policy": "none",
            "keep": None,
            "workload": "single",
            "goodput_rps": 1.0,
        },
        {"engine": "naive", "policy": "h2o", "keep": 0.2, "workload": "single", "goodput_rps": 0.8},
        {"engine": "eager", "policy": "h2o", "keep": 0.2, "workload": "single", "goodput_rps": 1.6},
        {
            "engine": "on_demand",
            "policy": "h2o",
            "keep": 0.2,
            "workload": "chat",
            "goodput_rps": 2.0,
        },
    ]
    by_engine = {(r["engine"], r["workload"]): r for r in ratios(rows)}
    assert by_engine[("eager", "single")]["vtoken_over_naive"] == 2.0
    assert by_engine[("eager", "single")]["vtoken_over_vanilla"] == 1.6
    assert by_engine[("on_demand", "chat")]["vtoken_over_naive"] is None  # no chat rows


@pytest.mark.slow
def test_quick_run_writes_the_documented_json(tmp_path):
    from serving.cli import app

    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    result = CliRunner().invoke(
        app,
        [
            "bench", "serve", "--quick", "--requests", "8", "--rates", "0.02,4",
            "--bisect-steps", "0", "--policies", "h2o:0.2",
            "--json", str(out), "--plot", str(png),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert png.stat().st_size > 0
    slo = document["slo"]
    fit = slo["unloaded_ttft_fit"]
    assert slo["ttft_slo_base_s"] == pytest.approx(5 * fit["base_s"], rel=1e-2, abs=1e-4)
    assert slo["ttft_slo_per_token_s"] == pytest.approx(5 * fit["per_token_s"], rel=1e-2, abs=1e-4)
    assert slo["tpot_slo_s"] == pytest.approx(3 * slo["unloaded_tpot_p50_s"], rel=1e-2, abs=1e-4)
    lengths = slo["unloaded_prompt_tokens"]
    assert len(lengths) == 8 and lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert set(document["workloads"]) == {"single", "chat"}
    rows = {(r["engine"], r["workload"]): r for r in document["results"]}
    assert set(rows) == {(e, w) for e in ENGINES for w in ("single", "chat")}
    for row in rows.values():
        assert set(row["slo_attainment"]) == {"0.02", "4.0"}
        assert row["goodput_bound"] in ("bisected", "at_least", "below_lowest")
        assert 0 < row["peak_blocks"] < document["num_blocks"]
        for point in row["per_rate"]:
            if not point["stopped_early"]:
                assert point["finished"] == point["requests"]
                assert point["ttft_s"]["p50"] <= point["e2e_s"]["p50"]
    for workload in ("single", "chat"):  # an idle engine meets its own SLOs
        assert rows[("vanilla", workload)]["slo_attainment"]["0.02"] == 1.0
        assert rows[("vanilla", workload)]["goodput_rps"] >= 0.02
    assert {(r["engine"], r["workload"]) for r in document["ratios"]} == {
        (e, w) for e in ("eager", "on_demand") for w in ("single", "chat")
    }
