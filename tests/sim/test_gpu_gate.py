"""Gate (c): the published rows, their matching, the within rule, the settings each row
runs with and small rows end to end (the full gate: ``vtoken sim validate --gates
gpu_tables``)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from serving.cli import app
from sim.cost_model import MODELS, gpu_cost_model
from sim.gpu_gate import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    gpu_tables_gate,
    row_settings,
    select_rows,
    simulate_row,
    within,
)
from sim.published import LLAMA_8B, LLAMA_70B, NUM_REQUESTS, ROWS, PublishedRow


def test_published_rows_carry_the_source_table() -> None:
    assert len(ROWS) == 40 and len({row.key for row in ROWS}) == 40
    for row in ROWS:
        assert row.shape in MODELS and row.dtype == "fp8"
        assert row.num_requests == NUM_REQUESTS[(row.isl, row.osl)]
        table = LLAMA_8B if row.shape == "llama-3.1-8b" else LLAMA_70B
        column = 0 if row.gpu == "h200" else 1
        assert row.output_tps == table[(row.isl, row.osl)][column]
        # Only the 70B H100 column is a TP2 group; per GPU it is half the table's figure.
        assert row.tp == (2 if (row.shape, row.gpu) == ("llama-3.1-70b", "h100") else 1)
        assert row.per_gpu_tps == pytest.approx(row.output_tps / row.tp)


def test_select_rows_matches_every_filter() -> None:
    rows = select_rows(models=["llama-3.1-8b"], gpus=["h100"])
    assert len(rows) == 10
    assert {(r.shape, r.gpu, r.tp) for r in rows} == {("llama-3.1-8b", "h100", 1)}
    long = select_rows(shapes=["20000/2000", "128/128"])
    assert len(long) == 8 and {(r.isl, r.osl) for r in long} == {(20000, 2000), (128, 128)}
    one = select_rows(models=["llama-3.1-70b"], gpus=["h100"], shapes=["2048/128"])
    assert [(r.tp, r.output_tps) for r in one] == [(2, 762.0)]
    assert select_rows() == list(ROWS)


def test_select_rows_refuses_filters_that_match_nothing() -> None:
    with pytest.raises(ValueError, match="no published row has model"):
        select_rows(models=["llama-3.1-8B"])  # case matters: a typo
    with pytest.raises(ValueError, match="ISL/OSL"):
        select_rows(shapes=["128-128"])
    only_h200 = tuple(r for r in ROWS if r.gpu == "h200" and r.shape == "llama-3.1-8b")
    with pytest.raises(ValueError, match="leave no published row"):
        select_rows(only_h200 + (replace(ROWS[-1], gpu="h100"),), models=["llama-3.1-8b"],
                    gpus=["h100"])  # fmt: skip


def test_within_is_fifteen_percent_of_the_published_figure() -> None:
    assert within(1000.0, 1150.0) and within(1000.0, 850.0) and within(1000.0, 1000.0)
    assert not within(1000.0, 1150.5) and not within(1000.0, 849.5)
    assert within(1000.0, 1040.0, tolerance=0.05) and not within(1000.0, 1060.0, 0.05)
    with pytest.raises(ValueError, match="positive"):
        within(0.0, 1.0)


def test_row_settings_admit_only_what_fits_whole() -> None:
    long = select_rows(models=["llama-3.1-8b"], gpus=["h200"], shapes=["20000/2000"])[0]
    cost = gpu_cost_model("h200", "llama-3.1-8b", "fp8", 1, BLOCK_SIZE)
    memory = 143_771 * 2**20  # what the driver reports for an H200
    blocks = int((memory * 0.9 - 8.03e9) // (2 * 32 * 8 * 128 * 1 * BLOCK_SIZE))
    settings = row_settings(long)
    assert settings.num_blocks == blocks == cost.kv_pool_blocks()
    assert settings.max_num_seqs == blocks // math.ceil(22000 / BLOCK_SIZE) < MAX_NUM_SEQS
    assert settings.max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS
    assert settings.num_requests == 1000 and row_settings(long, 7).num_requests == 7
    short = select_rows(models=["llama-3.1-8b"], gpus=["h200"], shapes=["128/128"])[0]
    assert row_settings(short).max_num_seqs == MAX_NUM_SEQS
    with pytest.raises(ValueError, match="does not fit"):
        row_settings(replace(long, isl=5_000_000))


def _decode_bound_seconds(row: PublishedRow, context: int) -> float:
    """One request's step on an idle 8B replica: host + weights + its KV (memory bound)."""
    cost = gpu_cost_model(row.gpu, row.shape, row.dtype, row.tp, BLOCK_SIZE)
    bandwidth = cost.device.hbm_bandwidth * cost.bandwidth_efficiency * row.tp
    kv = context * cost.model.kv_bytes_per_token(cost.kv_bytes)
    return cost.host_base_s + cost.host_per_request_s + (cost.model.parameters + kv) / bandwidth


def test_one_request_runs_its_prefill_and_decode_steps() -> None:
    # 128 prompt tokens in one step (its first output), then 3 decode steps: all memory
    # bound on an H200 in fp8, so each costs host + weights + KV read.
    row = PublishedRow("t", "llama-3.1-8b", "h200", "fp8", 1, 128, 4, 1.0, 1)
    measured = simulate_row(row)
    expected = sum(_decode_bound_seconds(row, 128 + k) for k in range(4))
    assert measured["steps"] == 4 and measured["preemptions"] == 0
    assert measured["makespan_s"] == pytest.approx(expected, rel=1e-3)
    assert measured["simulated_tps_per_gpu"] == pytest.approx(4 / expected, rel=1e-3)
    # Per GPU: a TP2 group's output over two.
    pair = simulate_row(replace(row, tp=2))
    assert pair["simulated_tps_per_gpu"] == pytest.approx(4 / pair["makespan_s"] / 2, rel=1e-3)


def test_a_long_row_never_preempts_and_fills_its_batch() -> None:
    # 70B on one H200: 18 whole 22k-token sequences fit; 40 requests run in three waves.
    row = select_rows(models=["llama-3.1-70b"], gpus=["h200"], shapes=["20000/2000"])[0]
    measured = simulate_row(row, num_requests=40)
    assert measured["settings"]["max_num_seqs"] == 18
    assert measured["preemptions"] == 0
    # Three waves of 2,000 decode steps, at least, and each of the 40 prefills' chunks.
    assert measured["steps"] >= 3 * 2000


def test_the_gate_reports_every_row_with_its_rule() -> None:
    rows = select_rows(models=["llama-3.1-8b"], gpus=["h100"], shapes=["2048/128", "5000/500"])
    gate = gpu_tables_gate(rows, num_requests=64)
    assert [r["row"] for r in gate["rows"]] == [r.key for r in rows]
    for result, row in zip(gate["rows"], rows, strict=True):
        assert result["published_tps_per_gpu"] == row.per_gpu_tps
        ratio = result["simulated_tps_per_gpu"] / row.per_gpu_tps
        assert result["ratio"] == pytest.approx(ratio, abs=1e-3)
        assert result["within"] == within(row.per_gpu_tps, result["simulated_tps_per_gpu"])
    assert gate["passed"] == all(r["within"] for r in gate["rows"])
    assert gate["rows_within"] == sum(r["within"] for r in gate["rows"])
    assert gate["source"]["commit"] and gate["tolerance"] == 0.15
    with pytest.raises(ValueError, match="tolerance"):
        gpu_tables_gate(rows, tolerance=1.5)


def test_exact_and_fast_replicas_agree_on_a_small_row() -> None:
    row = select_rows(models=["llama-3.1-8b"], gpus=["h200"], shapes=["2048/128"])[0]
    fast = simulate_row(row, num_requests=48, fidelity="fast")
    exact = simulate_row(row, num_requests=48, fidelity="exact")
    assert exact["steps"] == fast["steps"]
    assert exact["simulated_tps_per_gpu"] == pytest.approx(fast["simulated_tps_per_gpu"], 1e-6)


def test_validate_command_writes_the_gate(tmp_path) -> None:
    out = tmp_path / "gates.json"
    args = ["sim", "validate", "--gates", "gpu_tables", "--gpu-models", "llama-3.1-8b",
            "--gpu-gpus", "h200", "--gpu-shapes", "2048/128", "--gpu-requests", "64",
            "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    gate = json.loads(out.read_text())["gates"]["gpu_published"]
    assert [r["row"] for r in gate["rows"]] == ["llama-3.1-8b/h200/tp1/2048-128"]
    assert gate["rows"][0]["settings"]["num_requests"] == 64
    assert result.exit_code == (0 if gate["passed"] else 1), result.output
    assert "gpu_tables: passed=" in result.output
    bad = CliRunner().invoke(app, [*args[:4], "--gpu-models", "llama-9b", "--json", str(out)])
    assert bad.exit_code == 2 and "no published row has model" in bad.output


@pytest.mark.parametrize("option", ["--gpu-models", "--gpu-gpus", "--gpu-shapes"])
def test_an_empty_row_filter_is_refused_not_widened(tmp_path, option) -> None:
    # An empty value (an unset shell variable, say) must not silently select every row.
    narrow = {"--gpu-models": "llama-3.1-8b", "--gpu-gpus": "h200", "--gpu-shapes": "2048/128"}
    filters = [part for key, value in narrow.items() for part in (key, value * (key != option))]
    args = ["sim", "validate", "--gates", "gpu_tables", *filters, "--gpu-requests", "2",
            "--json", str(tmp_path / "gates.json")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "gates.json").exists()
