"""The quality benchmark: passkey prompts, answer checks and PAGE's calibration as pure
logic, and a quick run on SmolLM2 through real vLLM engines and the reference engine."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from bench.quality import (
    DEFAULT_THRESHOLD,
    HARM_TARGET,
    MULTI_KEYS,
    Answer,
    Cell,
    calibrate,
    is_correct,
    page_harm,
    page_section,
    passkey_cases,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from workers.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))


@pytest.fixture(scope="module")
def corpus(tokenizer):
    from bench.common import doc_tokens

    return doc_tokens(tokenizer)


@pytest.mark.parametrize("task", ["single", "multi"])
def test_passkey_prompts_hold_their_keys_at_their_lengths(tokenizer, corpus, task):
    cases = passkey_cases(tokenizer, corpus, 12, (512, 1024), task, seed=1)
    assert cases == passkey_cases(tokenizer, corpus, 12, (512, 1024), task, seed=1)
    assert len({c.key for c in cases}) > 1
    for case in cases:
        assert 512 <= len(case.prompt) <= 1024 and 0.1 <= case.depth <= 0.9
        text = tokenizer.decode(case.prompt)
        assert text.count(case.key) == 2  # "The pass key is K. Remember it. K is ..."
        assert text.rstrip().endswith("is")
        if task == "multi":
            asked = text.rsplit("pass key of ", 1)[1].split("?")[0].split()[0]
            assert f"pass key of {asked} is {case.key}." in text
            assert text.count("Remember it.") == MULTI_KEYS
        else:
            assert text.count("Remember it.") == 1


def test_the_answer_is_the_first_five_digit_number():
    assert is_correct(" 71432. Remember", "71432")
    assert not is_correct(" 12345 or 71432", "71432")
    assert not is_correct(" a special function", "71432")
    assert not is_correct(" 714321", "71432")  # a longer number is not the key


def test_page_harm_counts_only_gated_requests_that_lose_a_correct_answer():
    drops = [0.0, 0.2, 0.4, 0.6]
    full = [True, True, True, False]
    evicted = [False, True, False, False]
    # open above 0.3: requests 2 and 3; 2 was right with the full cache, wrong evicted
    assert page_harm(drops, full, evicted, 0.3) == (pytest.approx(1 / 3), 0.5)
    assert page_harm(drops, full, evicted, math.inf) == (0.0, 0.0)


def test_calibration_opens_the_gate_as_often_as_the_harm_target_allows():
    drops = [0.1 * i for i in range(40)]
    full = [True] * 40
    evicted = [i >= 20 for i in range(40)]  # eviction hurts the low-drop half
    threshold = calibrate(drops, full, evicted)
    harm, open_rate = page_harm(drops, full, evicted, threshold)
    assert harm <= HARM_TARGET and open_rate >= 0.5
    assert page_harm(drops, full, evicted, threshold - 0.1)[0] > HARM_TARGET
    assert calibrate(drops, full, [True] * 40) < min(drops)  # harmless: always open
    assert calibrate([-math.inf] * 3, full[:3], evicted[:3]) == math.inf


def test_the_default_threshold_is_pages():
    from policies.page import PAGE

    assert PAGE().threshold == DEFAULT_THRESHOLD


class GatedAnswers:
    """Stands in for the engine in ``page_section``: PAGE at a threshold answers as SnapKV
    where the recorded drop is above it and as the full cache elsewhere."""

    def __init__(self, drops, full, snap):
        self.drops, self.full, self.snap = drops, full, snap
        self.thresholds = []

    def answer(self, cases, spec):
        threshold = spec["policy_args"]["threshold"]
        self.thresholds.append(threshold)
        return [
            Answer(s if d > threshold else f, 16, 3 if d > threshold else 10, d, d > threshold)
            for d, f, s in zip(self.drops, self.full, self.snap, strict=True)
        ]


def test_page_is_calibrated_on_one_half_and_judged_on_the_other():
    drops = [0.01, 0.2, 0.3, 0.02, 0.25, 0.01, 0.4, 0.015]
    full = [True] * 8
    snap = [False, True, True, False, True, False, False, False]  # wrong on low drops and #6
    cases = {"single": [None] * 8}
    answers = {
        Cell("single", "vanilla", "none", None): [Answer(f, 16, 10) for f in full],
        Cell("single", "eager", "snapkv", 0.2): [Answer(c, 16, 3) for c in snap],
        Cell("single", "eager", "page", 0.2): [Answer(True, 16, 10, d, False) for d in drops],
    }
    engine = GatedAnswers(drops, full, snap)
    page = page_section(engine, cases, answers, 0.2)
    # calibration half (cases 0-3): opening above 0.02 loses nothing there
    assert engine.thresholds == [page.threshold] and 0.02 <= page.threshold < 0.2
    # evaluation half (cases 4-7): open on 4 (0.25, right) and 6 (0.4, wrong) -> 1 harmed of 4
    assert page.harm_rate == 0.25 and page.gate_open_rate == 0.5
    assert page.snapkv_harm_rate == 0.75  # SnapKV alone: 5, 6 and 7 wrong
    assert page.blocks_saved == pytest.approx((7 + 7) / 4)
    assert page.calibration_cases == page.evaluation_cases == 4


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three policies, token and block cells, perplexity: the longest
def test_quick_run_writes_the_documented_json(tmp_path):
    from serving.cli import app

    out, png = tmp_path / "quality.json", tmp_path / "quality.png"
    result = CliRunner().invoke(
        app,
        [
            "bench", "quality", "--quick", "--policies", "h2o,snapkv,page", "--keeps", "0.2",
            "--json", str(out), "--plot", str(png),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert png.stat().st_size > 0
    rows = {
        (r["task"], r["engine"], r["policy"], r["threshold"] is None): r
        for r in document["passkey"]
    }
    for task in ("single", "multi"):
        full = rows[(task, "vanilla", "none", True)]
        assert full["accuracy"] > full["random_guess"] and full["harm_rate"] == 0.0
        assert full["output_length_change"] == 0.0
        for policy in ("h2o", "snapkv", "page"):
            row = rows[(task, "eager", policy, True)]
            assert row["cases"] == 8 and 0.0 <= row["accuracy"] <= 1.0
        # keep 0.2 really evicts: fewer blocks held at the end than the full cache
        assert rows[(task, "eager", "h2o", True)]["mean_held_blocks"] < full["mean_held_blocks"]
        assert (task, "eager", "page", False) in rows  # PAGE at the calibrated threshold
        assert rows[(task, "on_demand", "h2o", True)]["cases"] == 8
        for policy in ("h2o", "snapkv", "page"):  # token vs block selection, whole blocks
            token, block = rows[(task, "token", policy, True)], rows[(task, "block", policy, True)]
            assert token["cases"] == block["cases"] == 8
            assert token["mean_held_blocks"] < full["mean_held_blocks"] or policy == "page"
            assert abs(block["mean_held_blocks"] - token["mean_held_blocks"]) <= 1.0
    page = document["page"]
    assert set(page) >= {
        "harm_rate",
        "snapkv_harm_rate",
        "gate_open_rate",
        "threshold",
        "blocks_saved",
    }
    assert 0.0 <= page["gate_open_rate"] <= 1.0 and page["drops"]["recorded"] == 16
    (ppl_full, *ppl_rows) = document["perplexity"]
    assert ppl_full["policy"] == "none" and ppl_full["relative"] == 1.0
    assert {r["policy"] for r in ppl_rows} == {"h2o", "snapkv", "page"}
    assert {(r["selection"], r["whole_blocks"]) for r in ppl_rows} == {
        ("token", False),
        ("token", True),
        ("block", True),
    }
    assert all(r["perplexity"] > 1.0 for r in document["perplexity"])
