"""`vtoken bench controller` at a small scale: every figure is there, reports carry as
many prefix keys as a pool has blocks (capped as reports are), followers get their
slices (the benchmark asserts that itself)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from bench.controller import TARGETS
from controlplane.prefix import MAX_REPORTED_KEYS
from serving.cli import app


def test_a_small_run_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "controller.json"
    args = ["bench", "controller", "--replicas", "12", "--tenants", "60", "--routes", "200"]
    result = CliRunner().invoke(app, [*args, "--rounds", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["prefix_keys_per_report"] == MAX_REPORTED_KEYS  # 4,096-block pools
    assert set(TARGETS) <= set(figures)
    for name in ("fanout_ms", "plan_write_ms", "router_refresh_ms", "slice_bytes_median"):
        assert figures[name] > 0
    assert figures["slice_bytes_median"] < figures["plan_json_bytes"]
