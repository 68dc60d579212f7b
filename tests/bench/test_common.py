"""What the benchmarks share: option parsing, percentiles, SLOs, JSON, figures, prompts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pytest
import typer

from bench.common import (
    PROMPT_TOPICS,
    TPOT_SLO_FACTOR,
    TTFT_SLO_FACTOR,
    Quantiles,
    Slo,
    csv_floats,
    csv_items,
    doc_tokens,
    natural_prompts,
    percentile,
    policy_names,
    pyplot,
    ratio,
    save_figure,
    score_layer_ids,
    write_json,
)


class WordTokenizer:
    """One token per space-separated word (ids: the words' lengths)."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [len(word) for word in text.split(" ")]}


def test_csv_items_strip_and_drop_blanks():
    assert csv_items(" a, b,,c ,") == ["a", "b", "c"]
    assert csv_items("") == []


def test_csv_floats_are_distinct_and_ascending():
    assert csv_floats("2, 0.5,2,1", "rates") == [0.5, 1.0, 2.0]
    with pytest.raises(typer.BadParameter, match="rates must be numbers"):
        csv_floats("1,x", "rates")


def test_policy_names_refuse_unknown_names_and_none_where_asked():
    assert policy_names("h2o, none") == ["h2o", "none"]
    for bad, allow_none in (("h2o,nope", True), ("none", False), (" , ", True)):
        with pytest.raises(typer.BadParameter, match="unknown policies"):
            policy_names(bad, allow_none=allow_none)


def test_score_layers_option_reads_all_spread_ids_and_ranges():
    assert score_layer_ids("all") == "all"
    assert score_layer_ids("spread:4") == 4
    assert score_layer_ids("0-29/9, 29") == [0, 9, 18, 27, 29]
    assert score_layer_ids("5,2-3") == [2, 3, 5]
    for bad in (
        "x",
        "3-1",
        "",
        "0-4/0",
        "spread:0",
        "spread:x",
        "-1",
        "spread:\u00b2",
        "3-",
        "3/2",
        "0-1000000000",
    ):
        with pytest.raises(typer.BadParameter, match="score-layers"):
            score_layer_ids(bad)


def test_percentile_is_nearest_rank_and_rounded():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.2) == 1.0 and percentile(values, 0.21) == 2.0
    assert percentile(values, 1.0) == 5.0
    assert percentile([1 / 3], 0.5) == 0.3333
    assert percentile([], 0.5) is None
    assert Quantiles.of([float(v) for v in range(1, 101)]) == Quantiles(50.0, 90.0, 99.0)
    assert asdict(Quantiles()) == {"p50": None, "p90": None, "p99": None}


def test_ratio_is_none_without_a_denominator():
    assert ratio(1.0, 3.0, 3) == 0.333
    assert ratio(1.0, 0.0, 3) is None and ratio(1.0, None, 3) is None


def test_slo_bounds_grow_with_the_prompt():
    slo = Slo(ttft_base_s=0.1, ttft_per_token_s=0.001, tpot_s=0.05)
    assert slo.ttft_s(100) == pytest.approx(0.2)
    assert slo.meets(0.2, 0.05, 100) and slo.meets(0.2, None, 100)
    assert not slo.meets(0.21, 0.01, 100) and not slo.meets(0.01, 0.06, 100)
    unloaded = Slo.from_unloaded(0.1, 0.001, 0.05)
    assert unloaded == Slo(TTFT_SLO_FACTOR * 0.1, TTFT_SLO_FACTOR * 0.001, TPOT_SLO_FACTOR * 0.05)


@dataclass(frozen=True, slots=True)
class _Row:
    b: int
    a: float | None


def test_write_json_keeps_field_order_and_ends_with_a_newline(tmp_path):
    path = tmp_path / "out.json"
    write_json(path, {"rows": [asdict(_Row(1, None))]}, indent=1)
    text = path.read_text()
    assert text == '{\n "rows": [\n  {\n   "b": 1,\n   "a": null\n  }\n ]\n}\n'
    assert json.loads(text) == {"rows": [{"b": 1, "a": None}]}


def test_save_figure_writes_a_png(tmp_path):
    plt = pyplot()
    figure, axis = plt.subplots()
    axis.plot([0, 1], [1, 0])
    save_figure(figure, tmp_path / "figure.png")
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")
    assert not plt.get_fignums()  # released


def test_prompts_come_from_cpythons_documentation():
    prompts = natural_prompts(WordTokenizer(), 2, 16)
    assert len(prompts) == 2 and all(len(p) == 16 for p in prompts)
    with pytest.raises(ValueError, match=PROMPT_TOPICS[0]):
        natural_prompts(WordTokenizer(), 1, 10**7)
    corpus, held_out = doc_tokens(WordTokenizer()), doc_tokens(WordTokenizer(), held_out=True)
    assert len(corpus) > len(held_out) > 0
