"""The serving benchmark: its workloads and goodput search as pure logic, and a quick run
on SmolLM2 through real vLLM engines (JSON structure and vanilla's attainment when idle)."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from bench.common import SLO_ATTAINMENT, Slo
from bench.serve import search_goodput, token_range
from bench.serve_results import CaseResult, ratios, summary, summary_lines
from bench.serve_trial import ENGINES, Trial, judge
from bench.serve_workloads import (
    Session,
    Turn,
    chat_workload,
    reasoning_workload,
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


def test_the_reasoning_workload_is_seeded_short_prompts_and_long_outputs():
    first = reasoning_workload(CORPUS, 200, (192, 320), (512, 1024), seed=5)
    assert first == reasoning_workload(CORPUS, 200, (192, 320), (512, 1024), seed=5)
    assert first != reasoning_workload(CORPUS, 200, (192, 320), (512, 1024), seed=6)
    assert first.name == "reasoning" and first.num_requests == 200
    starts = [s.start for s in first.sessions]
    assert starts == sorted(starts) and 150 < starts[-1] < 250  # Poisson, one per second
    prompts = [len(s.turns[0].user) for s in first.sessions]
    outputs = [s.turns[0].max_tokens for s in first.sessions]
    assert min(prompts) >= 192 and max(prompts) <= 320 and len(set(prompts)) > 50
    assert min(outputs) >= 512 and max(outputs) <= 1024 and len(set(outputs)) > 100
    assert all(len(s.turns) == 1 for s in first.sessions)
    assert first.max_len <= 320 + 1024
    assert first.params["prompt_tokens"] == [192, 320] and first.params["seed"] == 5
    # each prompt is a contiguous slice of the corpus
    turn = first.sessions[0].turns[0]
    offset = turn.user[0] - CORPUS[0]
    assert list(turn.user) == CORPUS[offset : offset + len(turn.user)]


def test_context_len_of_a_first_turn_is_its_prompt():
    session = Session(0.0, (Turn((1, 2, 3), 5), Turn((4,), 2)))
    assert session.context_len(0) == 3 and session.context_len(1) == 3 + 5 + 1


def _threshold_trials(capacity: float):
    """Trials that pass below ``capacity`` requests per second (a monotone engine)."""
    seen = []

    def trial_at(rate: float, stop_early: bool) -> Trial:
        seen.append((rate, stop_early))
        met = 10 if rate <= capacity else 5
        return Trial(rate=rate, met=met, missed=10 - met, total=10)

    return trial_at, seen


def test_goodput_is_bisected_between_the_last_pass_and_the_first_failure():
    trial_at, seen = _threshold_trials(1.3)
    goodput, bound, trials = search_goodput(trial_at, [0.5, 1.0, 2.0, 4.0], bisect_steps=3)
    assert bound == "bisected" and 1.0 <= goodput <= 1.3
    # the sweep runs to the end (the curve), bisection trials may stop once they fail
    assert seen[:4] == [(0.5, False), (1.0, False), (2.0, False), (4.0, False)]
    assert all(1.0 < r < 2.0 and stop for r, stop in seen[4:])
    assert len(trials) == 7
    assert search_goodput(trial_at, [0.5, 1.0, 2.0], bisect_steps=0)[:2] == (1.0, "bracketed")


def test_goodput_search_starts_below_the_first_failure():
    def trial_at(rate: float, stop_early: bool) -> Trial:  # a lucky pass above a failure
        met = 10 if rate in (0.5, 4.0) else 5
        return Trial(rate=rate, met=met, missed=10 - met, total=10)

    goodput, bound, _ = search_goodput(trial_at, [0.5, 1.0, 2.0, 4.0], bisect_steps=1)
    assert bound == "bisected" and 0.5 <= goodput < 1.0


def test_goodput_bounds_when_every_rate_passes_or_none_does():
    trial_at, _ = _threshold_trials(10.0)
    assert search_goodput(trial_at, [0.5, 1.0], 2)[:2] == (1.0, "at_least")
    trial_at, _ = _threshold_trials(0.1)
    assert search_goodput(trial_at, [0.5, 1.0], 2)[:2] == (0.0, "below_lowest")


def test_a_stopped_trial_reports_an_upper_bound_on_attainment():
    trial = Trial(rate=1.0, met=3, missed=2, total=10, stopped_early=True)
    assert trial.attainment == pytest.approx(0.8) and not trial.passed
    assert Trial(rate=1.0, met=9, missed=1, total=10).attainment == pytest.approx(SLO_ATTAINMENT)


def _row(engine, policy, keep, workload, goodput, bound="bisected"):
    return CaseResult(engine, policy, keep, workload, goodput, bound, {}, 0, 0, 0, [])


def test_ratios_pair_each_vtoken_row_with_naive_and_vanilla():
    rows = [
        _row("vanilla", "none", None, "single", 1.0, "at_least"),
        _row("naive", "h2o", 0.2, "single", 0.8),
        _row("eager", "h2o", 0.2, "single", 1.6),
        _row("on_demand", "h2o", 0.2, "chat", 2.0),
    ]
    by_engine = {(r.engine, r.workload): r for r in ratios(rows)}
    eager = by_engine[("eager", "single")]
    assert eager.vtoken_over_naive == 2.0 and eager.vtoken_over_naive_exact
    # vanilla passed every rate: the ratio is only a bound
    assert eager.vtoken_over_vanilla == 1.6 and not eager.vtoken_over_vanilla_exact
    assert by_engine[("on_demand", "chat")].vtoken_over_naive is None  # no chat rows


def test_summary_puts_on_demand_over_every_other_engine():
    rows = [
        _row("vanilla", "none", None, "reasoning", 0.5),
        _row("naive", "random", 0.2, "reasoning", 0.4),
        _row("eager", "random", 0.2, "reasoning", 0.8, "at_least"),
        _row("on_demand", "random", 0.2, "reasoning", 1.0),
        _row("on_demand", "h2o", 0.2, "reasoning", 0.0, "below_lowest"),
    ]
    by_policy = {s.policy: s for s in summary(rows)}
    random_row = by_policy["random"]
    assert random_row.on_demand_rps == 1.0
    assert random_row.over == {"vanilla": 2.0, "naive": 2.5, "eager": 1.25}
    assert random_row.exact == {"vanilla": True, "naive": True, "eager": False}
    assert by_policy["h2o"].over == {"vanilla": 0.0}  # no h2o rows of the others
    document = {"summary": [asdict(s) for s in summary(rows)]}
    assert summary_lines(document)[0] == (
        "reasoning random:0.2: on_demand 1.0 req/s (bisected); "
        "over 2.0x vanilla, 2.5x naive, 1.25x eager (bound)"
    )


def test_judge_names_the_bounds_a_request_missed():
    slo = Slo(1.0, 0.01, 0.05)  # TTFT 1 s + 10 ms per prompt token, TPOT 50 ms
    assert judge(slo, 1.9, 0.04, 100) == []
    assert judge(slo, 2.1, 0.04, 100) == ["ttft"]
    assert judge(slo, 1.0, 0.06, 100) == ["tpot"]
    assert judge(slo, 3.0, 0.06, 100) == ["ttft", "tpot"]
    assert judge(slo, 1.0, None, 100) == []  # one output token: no TPOT
    assert judge(None, 99.0, 9.0, 1) == []


@pytest.mark.parametrize(
    ("value", "message"),
    [("320,192", "1 <= MIN <= MAX"), ("0,10", "1 <= MIN <= MAX"), ("192", "two integers"),
     ("a,b", "two integers"), ("1,2,3", "two integers")],
)  # fmt: skip
def test_token_ranges_must_be_two_ordered_positive_integers(value, message):
    import typer

    assert token_range(" 192, 320 ", "--prompt-tokens") == (192, 320)
    with pytest.raises(typer.BadParameter, match=f"--output-tokens.*{message}"):
        token_range(value, "--output-tokens")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-tokens", "320,192"], "--prompt-tokens must have 1 <= MIN <= MAX"),
        (["--output-tokens", "64"], "--output-tokens must be MIN,MAX"),
        (["--workloads", "reasoning,single"], "reasoning runs alone"),
        (["--workloads", "reasoning", "--engines", "vanilla,paged"], "engines must be among"),
        (["--max-num-batched-tokens", "32"], "max-num-batched-tokens"),
        (["--tpot-factor", "0.5"], "tpot-factor"),
    ],
)
def test_the_cli_refuses_bad_options_before_building_anything(args, message):
    from serving.cli import app

    result = CliRunner().invoke(app, ["bench", "serve", "--quick", *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert message in re.sub(r"[\s│]+", " ", result.output)


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
        assert set(row["slo_attainment"]) == {"0.02", "4"}
        assert row["goodput_bound"] in ("bracketed", "at_least", "below_lowest")
        assert 0 < row["peak_blocks"] < document["num_blocks"]
        for point in row["per_rate"]:
            assert not point["stopped_early"]  # sweep rates run to the end
            assert point["finished"] == point["requests"]
            assert point["ttft_s"]["p99"] <= point["e2e_s"]["p99"]
    for workload in ("single", "chat"):  # an idle engine meets its own SLOs
        assert rows[("vanilla", workload)]["slo_attainment"]["0.02"] == 1.0
        assert rows[("vanilla", workload)]["goodput_rps"] >= 0.02
    assert {(r["engine"], r["workload"]) for r in document["ratios"]} == {
        (e, w) for e in ("eager", "on_demand") for w in ("single", "chat")
    }


@pytest.mark.slow
def test_quick_reasoning_run_keeps_every_requests_outcome(tmp_path):
    """The quick reasoning preset: 8 requests of 48-80 prompt and 48-64 output tokens (up
    to 5 blocks each) on 16 blocks. At 4 per second they all run at once: vanilla must
    preempt, vToken evicts."""
    from serving.cli import app

    out = tmp_path / "reasoning.json"
    result = CliRunner().invoke(
        app,
        [
            "bench", "serve", "--quick", "--workloads", "reasoning", "--engines",
            "vanilla,on_demand", "--policies", "random:0.2", "--bisect-steps", "0",
            "--json", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "reasoning random:0.2: on_demand" in result.output
    document = json.loads(out.read_text())
    assert document["num_blocks"] == 16 and document["max_num_batched_tokens"] == 64
    assert document["workloads"]["reasoning"]["prompt_tokens"] == [48, 80]
    rows = {r["engine"]: r for r in document["results"]}
    assert set(rows) == {"vanilla", "on_demand"} and set(document["rates"]) == {0.05, 4.0}
    tpot_slo = document["slo"]["tpot_slo_s"]
    for engine, row in rows.items():
        for point in row["per_rate"]:
            outcomes = point["outcomes"]
            assert len(outcomes) == point["finished"] == point["requests"] == 8
            assert sorted(o["session"] for o in outcomes) == list(range(8))
            for o in outcomes:
                assert o["request"] == f"s{o['session']}t0"
                assert 48 <= o["prompt_tokens"] <= 80 and 48 <= o["output_tokens"] <= 64
                assert 0 < o["ttft_s"] <= o["e2e_s"] and o["tpot_s"] > 0
                assert o["met_slo"] == (o["missed"] == [])
                assert ("tpot" in o["missed"]) == (o["tpot_s"] > tpot_slo)
                assert (o["evicted_tokens"] is None) == (engine == "vanilla")
            met = sum(o["met_slo"] for o in outcomes)
            assert point["slo_attainment"] == pytest.approx(met / 8, abs=1e-4)
            assert point["preempted_requests"] == sum(o["preemptions"] > 0 for o in outcomes)
            assert point["preemptions"] == sum(o["preemptions"] for o in outcomes)
    idle, busy = rows["vanilla"]["per_rate"]
    assert idle["preemptions"] == 0 and busy["preemptions"] > 0  # memory binds at 4/s
    on_demand = rows["on_demand"]["per_rate"]
    for point in on_demand:
        for o in point["outcomes"]:  # an evicted token was a prompt or an output token
            assert 0 <= o["evicted_tokens"] < o["prompt_tokens"] + o["output_tokens"]
    assert sum(o["evicted_tokens"] for o in on_demand[1]["outcomes"]) > 0
    (row,) = document["summary"]
    assert row["workload"] == "reasoning" and set(row["over"]) == {"vanilla"}


class FakeEngine:
    """A pure-logic stand-in for ``ServeEngine`` (run_trial's bookkeeping only): each step
    prefills every new request (``prefill_s``) or decodes one token for every running one
    (``decode_s``), advancing a fake clock."""

    kind = "eager"

    def __init__(self, clock, prefill_s: float, decode_s: float) -> None:
        self.clock, self.prefill_s, self.decode_s = clock, prefill_s, decode_s
        self.engine = self
        self.num_preemptions, self.preemptions, self.peak_blocks = 0, Counter(), 0
        self.running: dict[str, dict] = {}
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params):
        self.prompts[request_id] = list(prompt["prompt_token_ids"])
        self.running[request_id] = {"max": params.max_tokens, "tokens": [], "new": True}
        return f"{request_id}-internal"

    def evicted_tokens(self, internal_id):
        return 3 if internal_id.endswith("-internal") else None

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, request_ids):
        self.aborted += request_ids
        for request_id in request_ids:
            self.running.pop(request_id)

    def step(self):
        from types import SimpleNamespace

        new = [r for r in self.running.values() if r["new"]]
        self.clock.now += self.prefill_s if new else self.decode_s
        outputs = []
        for request_id, request in list(self.running.items()):
            if new and not request["new"]:
                continue  # decodes wait for the prefill step
            request["new"] = False
            request["tokens"].append(7000 + len(request["tokens"]))
            finished = len(request["tokens"]) == request["max"]
            if finished:
                del self.running[request_id]
            completion = SimpleNamespace(token_ids=list(request["tokens"]))
            outputs.append(
                SimpleNamespace(request_id=request_id, finished=finished, outputs=[completion])
            )
        return outputs


@pytest.fixture
def fake_clock(monkeypatch):
    from types import SimpleNamespace

    import bench.serve_trial

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(bench.serve_trial, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    return clock


def test_an_idle_engine_gives_each_request_its_own_step_times(fake_clock):
    from bench.serve_trial import Workload, run_trial

    engine = FakeEngine(fake_clock, prefill_s=0.2, decode_s=0.01)
    sessions = tuple(Session(10.0 * i, (Turn((1, 2, 3), 5),)) for i in range(1, 4))
    trial = run_trial(engine, Workload("single", sessions, {}), 1.0, Slo(1.0, 0.0, 0.05), "t")
    assert trial.total == trial.met == 3 and not trial.stopped_early
    for outcome in trial.outcomes:
        assert outcome.ttft_s == pytest.approx(0.2)
        assert outcome.tpot_s == pytest.approx(0.01)
        assert outcome.e2e_s == pytest.approx(0.2 + 4 * 0.01)
        assert outcome.prompt_tokens == 3 and outcome.output_tokens == 5
        assert outcome.met_slo and outcome.missed == [] and outcome.evicted_tokens == 3


def test_a_chat_turn_carries_the_conversation_and_its_answers(fake_clock):
    from bench.serve_trial import Workload, run_trial

    engine = FakeEngine(fake_clock, prefill_s=0.1, decode_s=0.01)
    session = Session(0.0, (Turn((1, 2), 3), Turn((5,), 2)), think_s=0.5)
    trial = run_trial(engine, Workload("chat", (session,), {}), 1.0, None, "c")
    assert len(trial.outcomes) == 2
    assert engine.prompts["cs0t1"] == [1, 2, 7000, 7001, 7002, 5]


def test_an_overloaded_trial_stops_once_it_cannot_pass(fake_clock):
    from bench.serve_trial import Workload, run_trial

    engine = FakeEngine(fake_clock, prefill_s=1.0, decode_s=0.01)
    sessions = tuple(Session(1.5 * i, (Turn((1,) * 8, 4),)) for i in range(20))
    workload = Workload("single", sessions, {})
    slo = Slo(0.5, 0.0, 1.0)  # every prefill step alone takes 1 s: all miss TTFT
    stopped = run_trial(engine, workload, 1.0, slo, "o", stop_early=True)
    assert stopped.stopped_early and not stopped.passed
    assert stopped.missed == 3 and len(stopped.outcomes) == 3  # stopped at the 3rd miss of 20
    assert stopped.summary().slo_attainment is None
    full = run_trial(FakeEngine(fake_clock, 1.0, 0.01), workload, 1.0, slo, "f")
    assert not full.stopped_early and len(full.outcomes) == 20 and full.attainment == 0.0
