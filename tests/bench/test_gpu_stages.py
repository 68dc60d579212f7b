"""The GPU checks' stage helpers (``bench/gpu_stages.sh``) in bash, with real commands, real
verdicts (``bench/gpu_verdict.py``) and a real pytest run; and both checks on a machine
without CUDA (every GPU stage NOT RUN, a failing exit status)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = os.environ | {
    "PYTHON": sys.executable,
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # pytest alone: faster
    "CUDA_VISIBLE_DEVICES": "",  # the checks' no-CUDA path, whatever this machine has
}


def _stages(tmp_path: Path, script: str, deadline: int | None = None) -> tuple[int, str, list[str]]:
    """Run ``script`` after sourcing the helpers and ``begin OUT`` (the check's deadline
    ``deadline`` seconds, else the default); the exit status, the output and
    OUT/summary.txt's lines."""
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", "-c", f'source bench/gpu_stages.sh && begin "$1" && {script}', "_", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=ENV | ({} if deadline is None else {"DEADLINE_S": str(deadline)}),
    )  # fmt: skip
    summary = (out / "summary.txt").read_text().splitlines()
    return result.returncode, result.stdout + result.stderr, summary


def _doc(tmp_path: Path, name: str, document: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


def _run(target_met: bool | None) -> dict:
    return {"target": "t", "cases": [{"pattern": "compact50", "target_met": target_met}]}


def test_a_stage_passes_only_when_its_output_does(tmp_path):
    met, missed = _doc(tmp_path, "met.json", _run(True)), _doc(tmp_path, "missed.json", _run(False))
    graph = _doc(tmp_path, "graph.json", {"live_attention_tolerance": 0.02, "rounds": []})
    stale = tmp_path / "out" / "stale.json"
    stale.parent.mkdir()
    stale.write_text(json.dumps(_run(True)))
    code, output, summary = _stages(
        tmp_path,
        f"""
        stage plain 10 - - true
        stage met 10 repack "$OUT/met.json" cp {met} "$OUT/met.json"
        stage missed 10 repack "$OUT/missed.json" cp {missed} "$OUT/missed.json"
        stage crashed 10 cuda-graph "$OUT/g" bash -c 'cp "$1" "$2"; exit 4' _ {graph} "$OUT/g"
        stage silent 10 scores "$OUT/none.json" true
        stage stale 10 repack "$OUT/stale.json" true
        stage slow 1 - - sleep 30
        not_run absent "no device"
        finish
        """,
    )
    assert code == 1, output
    assert re.fullmatch(r"plain +PASS +\d+s", summary[0])
    assert summary[1].split()[:2] == ["met", "PASS"]
    assert summary[1].endswith("; 1 of 1 cases meet the target")
    assert summary[2].split()[:2] == ["missed", "FAIL"]
    assert "1 of 1 cases miss the target (t): pattern=compact50" in summary[2]
    assert re.fullmatch(r"crashed +FAIL +exit status 4 after \d+s: no round ran", summary[3])
    assert summary[4].split()[:2] == ["silent", "FAIL"] and "No such file" in summary[4]
    assert summary[5].split()[:2] == ["stale", "FAIL"]  # removed before the stage ran
    assert summary[6].split() == ["slow", "FAIL", "timed", "out", "after", "1s"]
    assert summary[7].split() == ["absent", "NOT", "RUN", "no", "device"]
    assert output.rstrip().endswith(summary[-1])  # the summary printed last


def test_the_deadline_cuts_stages_and_a_kill_is_not_a_timeout(tmp_path):
    code, output, summary = _stages(
        tmp_path,
        """
        stage oom 10 - - bash -c 'kill -9 $$'
        stage long 10 - - sleep 30
        stage late 10 - - true
        finish
        """,
        deadline=3,
    )
    assert code == 1, output
    assert re.fullmatch(
        r"oom +FAIL +killed \(exit 137: SIGKILL, out of memory\?\) after \ds", summary[0]
    )
    assert re.fullmatch(
        r"long +FAIL +timed out after [23]s \(cut from 10s by the check's 3s deadline\)", summary[1]
    )
    assert summary[2].split(None, 3) == [
        "late",
        "NOT",
        "RUN",
        "not started: the check's 3s deadline was reached",
    ]


def test_begin_removes_the_outputs_it_lists(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("env.json", "tests.xml", "kept.txt"):
        (out / name).write_text("stale")
    script = 'source bench/gpu_stages.sh && begin "$1" env.json tests.xml'
    subprocess.run(
        ["bash", "-c", script, "_", str(out)],
        check=True, cwd=ROOT, env=ENV, timeout=60,
    )  # fmt: skip
    assert sorted(path.name for path in out.iterdir()) == ["kept.txt", "summary.txt"]


def test_every_stage_passing_exits_zero(tmp_path):
    met = _doc(tmp_path, "met.json", _run(True))
    code, output, summary = _stages(
        tmp_path,
        f'stage a 10 - - true && stage b 10 repack "$OUT/b.json" cp {met} "$OUT/b.json" && finish',
    )
    assert code == 0, output
    assert [line.split()[1] for line in summary] == ["PASS", "PASS"]


def test_a_test_stage_in_which_every_test_skipped_is_not_run(tmp_path):
    tests = tmp_path / "test_skips.py"
    tests.write_text(
        "import pytest\n\n@pytest.mark.skip(reason='no device')\ndef test_a():\n    pass\n"
    )
    passing = tmp_path / "test_passes.py"
    passing.write_text("def test_a():\n    pass\n")
    code, output, summary = _stages(
        tmp_path,
        f"""
        pytest_stage skipped 60 kernel-tests "$OUT/skipped" {tests}
        pytest_stage passed 60 kernel-tests "$OUT/passed" {passing}
        pytest_stage engine 60 engine-tests "$OUT/engine" {tests} {passing}
        finish
        """,
    )
    assert code == 1, output
    assert summary[0].split()[:3] == ["skipped", "NOT", "RUN"]
    assert summary[0].endswith("0 passed: all 1 tests skipped")
    assert re.fullmatch(r"passed +PASS +\d+s; 1 passed, 0 skipped", summary[1])
    assert re.fullmatch(r"engine +FAIL +1 of 2 tests skipped", summary[2])
    assert (tmp_path / "out" / "skipped.xml").exists()
    assert "1 skipped" in (tmp_path / "out" / "skipped.txt").read_text()


def test_the_gpu_check_without_cuda_fails_with_every_gpu_stage_not_run(tmp_path):
    (tmp_path / "scores-gpu.json").write_text("stale")  # from an earlier run: removed
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].split()[:2] == ["env", "PASS"]
    stages = ["kernel-tests", "repack", "repack-variants", "scores", "fused-scores"]
    stages += ["cuda-graph", "runner-harness"]
    assert [line.split()[0] for line in summary[1:]] == stages
    assert all(line.split()[1:3] == ["NOT", "RUN"] for line in summary[1:])
    assert all(line.endswith("NOT RUN  no CUDA device visible to PyTorch") for line in summary[1:])
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["device"] is None
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["numpy"] and env["pytest"] and env["torch"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["env.json", "summary.txt"]


def test_the_engine_check_without_vllms_cuda_build_is_not_run(tmp_path):
    result = subprocess.run(
        ["bash", "bench/gpu_engine_check.sh", str(tmp_path), "flash_attn", "triton_attn"],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[:3] for line in summary] == [
        ["engine-flash_attn", "NOT", "RUN"],
        ["engine-triton_attn", "NOT", "RUN"],
    ]


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_probe"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip


def test_the_probe_names_what_is_missing(tmp_path, monkeypatch):
    """Each precondition that is not the product, one at a time: the probe's one line."""
    no_cuda = _probe(ENV)
    assert (no_cuda.returncode, no_cuda.stdout) == (1, "no CUDA device visible to PyTorch\n")
    broken = tmp_path / "site"
    broken.mkdir()
    (broken / "numpy.py").write_text("raise ImportError('numpy is broken here')\n")
    no_numpy = _probe(ENV | {"PYTHONPATH": f"{broken}:{ROOT}"})
    assert no_numpy.returncode == 1
    assert no_numpy.stdout == "cannot import numpy: numpy is broken here\n"
    from bench import gpu_probe

    monkeypatch.setattr(gpu_probe, "MIN_PYTHON", (99, 0))
    assert gpu_probe.missing().endswith("the checkout needs Python >= 99.0")


def test_the_probes_triton_kernel_runs_and_checks_what_it_wrote():
    """The kernel the probe builds on CUDA, run here by Triton's interpreter."""
    code = (
        "import os; os.environ['TRITON_INTERPRET'] = '1'\n"
        "from bench.gpu_probe import run_triton_kernel\n"
        "print(repr(run_triton_kernel('cpu')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "''\n"
