"""The GPU check's stage verdicts (``bench/gpu_verdict.py``): benchmark documents made by
hand in the shapes the benchmarks write, pytest's JUnit XML from real pytest runs, and
the CPU runs of the benchmarks that can run here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.gpu_verdict import KINDS, JunitCounts, State, judge, junit_counts, junit_verdict, main


def _write(tmp_path: Path, document: Any, name: str = "run.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


def _repack_case(pattern: str, target_met: bool | None, ratio: float = 0.9) -> dict:
    return {
        "shape": "llama8b", "kv_cache_layout": "LBNHC", "dtype": "bfloat16", "block_size": 16,
        "pattern": pattern, "ratio": ratio, "device_ratio": ratio, "target_met": target_met,
    }  # fmt: skip


def _repack_run(*cases: dict) -> dict:
    return {"device": "NVIDIA H200", "target": "compaction >= 0.8x", "cases": list(cases)}


# ---------------------------------------------------------------- benchmarks' targets


def test_a_repack_run_meeting_every_target_passes(tmp_path):
    path = _write(
        tmp_path, _repack_run(_repack_case("compact50", True), _repack_case("trickle", None))
    )
    verdict = judge("repack", path)
    assert verdict.state is State.PASS
    assert verdict.reason == "1 of 1 cases meet the target"


def test_a_missed_target_fails_and_names_the_case(tmp_path):
    path = _write(
        tmp_path,
        _repack_run(
            _repack_case("compact50", False, ratio=0.48),
            _repack_case("compact80", True),
            _repack_case("trickle", None, ratio=0.2),
        ),
    )
    verdict = judge("repack", path)
    assert verdict.state is State.FAIL
    assert verdict.reason.startswith("1 of 2 cases miss the target (compaction >= 0.8x): ")
    assert "pattern=compact50 ratio=0.48" in verdict.reason
    assert "compact80" not in verdict.reason and "trickle" not in verdict.reason


def test_a_run_with_no_case_judged_fails(tmp_path):
    """A CPU run (every ``target_met`` null) proves nothing about the GPU targets."""
    path = _write(tmp_path, _repack_run(_repack_case("trickle", None)))
    verdict = judge("repack", path)
    assert verdict.state is State.FAIL and "no case was judged" in verdict.reason
    assert judge("repack", _write(tmp_path, _repack_run())).reason == "no case ran"


def test_many_misses_are_cut_to_one_line(tmp_path):
    cases = [_repack_case(f"compact{n}", False) | {"block_size": n} for n in range(10)]
    verdict = judge("repack", _write(tmp_path, _repack_run(*cases)))
    assert verdict.state is State.FAIL and "\n" not in verdict.reason
    assert verdict.reason.startswith("10 of 10 cases miss") and verdict.reason.endswith("; ...")
    assert verdict.reason.count("pattern=") == 3


def test_repack_variants_judge_every_run_of_the_list(tmp_path):
    good = _repack_run(_repack_case("compact50", True))
    bad = _repack_run(_repack_case("compact50", False) | {"kv_cache_layout": "BLHNC"})
    assert judge("repack-variants", _write(tmp_path, [good, good])).state is State.PASS
    verdict = judge("repack-variants", _write(tmp_path, [good, bad]))
    assert verdict.state is State.FAIL and "kv_cache_layout=BLHNC" in verdict.reason
    assert judge("repack-variants", _write(tmp_path, [])).state is State.FAIL
    assert judge("repack-variants", _write(tmp_path, good)).state is State.FAIL  # not a list


def test_scores_cases_are_judged_alike(tmp_path):
    case = {"shape": "llama8b", "batch": 32, "seq_len": 4096, "q_len": 1, "ratio": 2.64}
    run = {"target": "<= 1.0x", "cases": [case | {"target_met": False}]}
    verdict = judge("scores", _write(tmp_path, run))
    assert verdict.state is State.FAIL
    assert "batch=32 seq_len=4096 q_len=1 ratio=2.64" in verdict.reason


def _fused_run(diff: float, target_met: bool | None = True, tolerance: Any = 1e-3) -> dict:
    case = {"shape": "llama8b", "batch": 32, "seq_len": 4096, "max_abs_diff": diff}
    return {"max_abs_diff_tolerance": tolerance, "cases": [case | {"target_met": target_met}]}


def test_fused_scores_fail_on_a_mass_off_by_more_than_the_tolerance(tmp_path):
    passed = judge("fused-scores", _write(tmp_path, _fused_run(2e-5)))
    assert passed.state is State.PASS
    assert passed.reason == "1 of 1 cases meet the target, every max_abs_diff within 0.001"
    for diff in (0.02, math.nan):
        verdict = judge("fused-scores", _write(tmp_path, _fused_run(diff)))
        assert verdict.state is State.FAIL
        assert f"max_abs_diff {diff} > 0.001" in verdict.reason
    # A wrong mass fails even where the speed target is met, and is named first.
    verdict = judge("fused-scores", _write(tmp_path, _fused_run(0.5, target_met=False)))
    assert "cases wrong" in verdict.reason


def test_documents_lacking_a_field_fail_with_the_reason(tmp_path):
    no_tolerance = _fused_run(0.0)
    del no_tolerance["max_abs_diff_tolerance"]
    reasons = {
        "fused-scores": (no_tolerance, "has no 'max_abs_diff_tolerance'"),
        "repack": ({"cases": [{"pattern": "compact50"}]}, "has no 'target_met'"),
        "scores": ({"cases": [{"target_met": "yes"}]}, "target_met must be true, false or null"),
        "cuda-graph": ({"rounds": []}, "has no 'live_attention_tolerance'"),
        "runner-harness": ({"tolerance": "1e-3"}, "not a number"),
    }
    for kind, (document, reason) in reasons.items():
        verdict = judge(kind, _write(tmp_path, document))
        assert verdict.state is State.FAIL and reason in verdict.reason, (kind, verdict)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    assert judge("repack", bad_json).state is State.FAIL
    missing = judge("scores", tmp_path / "absent.json")
    assert missing.state is State.FAIL and "No such file" in missing.reason
    with pytest.raises(ValueError, match="unknown kind"):
        judge("speed", bad_json)


# ---------------------------------------------------------------- cuda graph, harness


def _graph_run(*rounds: tuple[float, float]) -> dict:
    return {
        "ok": True,
        "live_attention_tolerance": 2e-2,
        "rounds": [
            {
                "round": i,
                "moves": 900,
                "max_abs_diff": eager,
                "max_abs_diff_vs_live_attention": live,
            }
            for i, (eager, live) in enumerate(rounds)
        ],
    }


def test_cuda_graph_replay_must_equal_eager_and_live_attention(tmp_path):
    verdict = judge("cuda-graph", _write(tmp_path, _graph_run((0.0, 0.002), (0.0, 0.001))))
    assert verdict.state is State.PASS and verdict.reason.startswith("2 rounds")
    verdict = judge("cuda-graph", _write(tmp_path, _graph_run((0.0, 0.002), (0.0078, 0.001))))
    assert verdict.reason == "round 1: replay differs from eager by 0.0078"
    verdict = judge("cuda-graph", _write(tmp_path, _graph_run((0.0, 0.5))))
    assert verdict.state is State.FAIL and "live tokens by 0.5 (tolerance 0.02)" in verdict.reason
    assert judge("cuda-graph", _write(tmp_path, _graph_run())).reason == "no round ran"


def _harness_run(fenced: list[float], unfenced: list[float]) -> dict:
    return {
        "ok": True,  # not trusted: the verdict reads the errors
        "tolerance": 1e-3,
        "fenced": {"fence": True, "max_errors": fenced, "passed": True},
        "negative_control_unfenced": {"fence": False, "max_errors": unfenced, "passed": False},
    }


def test_runner_harness_needs_a_clean_fenced_run_and_a_failing_control(tmp_path):
    verdict = judge("runner-harness", _write(tmp_path, _harness_run([1e-6, 2e-6], [1e-6, 0.4])))
    assert verdict.state is State.PASS and "negative control failed" in verdict.reason
    verdict = judge("runner-harness", _write(tmp_path, _harness_run([1e-6, 0.01], [0.4])))
    assert verdict.reason == "fenced run, step 1: error 0.01 >= 0.001"
    verdict = judge("runner-harness", _write(tmp_path, _harness_run([1e-6], [1e-6, 2e-6])))
    assert verdict.state is State.FAIL
    assert verdict.reason.startswith("the negative control (no fence) did not fail")
    nan = judge("runner-harness", _write(tmp_path, _harness_run([1e-6], [math.nan])))
    assert nan.state is State.PASS  # a NaN step is a failed step of the control
    assert judge("runner-harness", _write(tmp_path, _harness_run([], [0.4]))).state is State.FAIL


def test_the_harness_run_on_cpu_cannot_pass_the_gpu_check(tmp_path):
    """On CPU the repack is synchronous: the unfenced control passes, so the harness's own
    output (``bench.runner_harness.main``) must fail the stage."""
    from bench.runner_harness import main as harness_main

    path = tmp_path / "runner-harness.json"
    assert harness_main([str(path), "--device", "cpu"]) == 1
    verdict = judge("runner-harness", path)
    assert verdict.state is State.FAIL and "did not fail" in verdict.reason


# ---------------------------------------------------------------- test runs


def _pytest_junit(tmp_path: Path, source: str) -> tuple[int, Path]:
    """Run a real pytest on a test file holding ``source``; its exit code and JUnit XML."""
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(source)
    report = tmp_path / "report.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file),
         f"--junitxml={report}", "--rootdir", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
        env=os.environ | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # pytest alone: faster
    )  # fmt: skip
    return result.returncode, report


SKIPPING = (
    "import pytest\n\n@pytest.mark.skip(reason='this CPU has no AMX tiles')\n"
    "def test_a():\n    pass\n"
)


@pytest.mark.parametrize(
    ("source", "exit_code", "kernel", "engine"),
    [
        ("def test_a():\n    pass\n" + SKIPPING.replace("test_a", "test_b"), 0,
         (State.PASS, "1 passed, 1 skipped"), (State.FAIL, "1 of 2 tests skipped")),
        (SKIPPING, 0, (State.NOT_RUN, "0 passed: all 1 tests skipped"), None),
        ("", 5, (State.NOT_RUN, "no test collected"), None),
        ("def test_a():\n    assert False\n\ndef test_b():\n    pass\n", 1,
         (State.FAIL, "1 failed, 0 errors of 2 tests"), None),
        ("import nowhere_to_be_found\n", 2, (State.FAIL, "0 failed, 1 errors of 1 tests"), None),
    ],
    ids=["passed-and-skipped", "all-skipped", "none-collected", "failed", "collection-error"],
)  # fmt: skip
def test_a_test_run_passes_only_when_a_test_passed(
    tmp_path, source, exit_code, kernel, engine
) -> None:
    """Every test skipped passes pytest (exit 0) but not the stage: NOT RUN."""
    code, report = _pytest_junit(tmp_path, source)
    assert code == exit_code
    verdict = judge("kernel-tests", report)
    assert (verdict.state, verdict.reason) == kernel
    engine_verdict = judge("engine-tests", report)
    assert (engine_verdict.state, engine_verdict.reason) == (engine or kernel)


def test_junit_counts_add_every_suite(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(
        '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1"/>'
        '<testsuite tests="2" failures="1" errors="0" skipped="0"/></testsuites>'
    )
    assert junit_counts(path) == JunitCounts(tests=5, failures=1, errors=0, skipped=1)
    path.write_text("<testsuites/>")
    assert "no <testsuite>" in judge("kernel-tests", path).reason
    path.write_text('<testsuite tests="many"/>')
    assert "is not a count" in judge("kernel-tests", path).reason
    path.write_text("<testsuite")
    assert judge("kernel-tests", path).state is State.FAIL
    assert junit_verdict(JunitCounts(4, 0, 0, 4), allow_skips=True).state is State.NOT_RUN


def _junit(*cases: str) -> str:
    """Hand-made JUnit XML as pytest writes it: one suite of ``cases`` (``<testcase>``)."""
    skipped = sum("<skipped" in case for case in cases)
    return (
        f'<testsuites><testsuite tests="{len(cases)}" failures="0" errors="0" '
        f'skipped="{skipped}">{"".join(cases)}</testsuite></testsuites>'
    )


def _skipped(message: str) -> str:
    return (
        f'<testcase classname="tests.kernels.t" name="test_x"><skipped type="pytest.skip" '
        f'message="{message}">tests/kernels/t.py:9: {message}</skipped></testcase>'
    )


PASSED = '<testcase classname="tests.kernels.t" name="test_ok" time="0.1"/>'


def test_kernel_tests_fail_on_a_skip_not_expected_on_a_cuda_machine(tmp_path):
    """Skips of CPU-only and vLLM-needing tests pass; any other reason (Triton unusable, a
    CUDA-only test skipped) fails and is named, with its count."""
    path = tmp_path / "tests.xml"
    expected = [
        "this CPU has no AMX tiles",
        "could not import &apos;vllm._custom_ops&apos;: No module named &apos;vllm&apos;",
        "vLLM is not installed",
        "not the CPU build of vLLM",
        "the probe runs vLLM&apos;s kernel under the Triton interpreter",
    ]
    path.write_text(_junit(PASSED, *(_skipped(message) for message in expected)))
    verdict = judge("kernel-tests", path)
    assert (verdict.state, verdict.reason) == (State.PASS, "1 passed, 5 skipped")
    unexpected = ["Triton kernels cannot run here"] * 3 + ["stream ordering needs CUDA"]
    path.write_text(_junit(PASSED, _skipped(expected[0]), *map(_skipped, unexpected)))
    verdict = judge("kernel-tests", path)
    assert verdict.state is State.FAIL
    assert verdict.reason == (
        "4 of 6 tests skipped for a reason not expected on a CUDA machine: "
        "3x 'Triton kernels cannot run here'; 1x 'stream ordering needs CUDA'"
    )
    # The engine tests allow no skip at all, whatever the reason.
    path.write_text(_junit(PASSED, _skipped(expected[0])))
    assert judge("engine-tests", path).reason == "1 of 2 tests skipped"
    # Counts that disagree with the skipped test cases: the document is wrong.
    path.write_text(
        _junit(PASSED, PASSED, _skipped(expected[0])).replace('skipped="1"', 'skipped="2"')
    )
    verdict = judge("kernel-tests", path)
    assert verdict.state is State.FAIL and "2 tests skipped but 1 <skipped>" in verdict.reason


def test_a_real_pytest_skip_reason_is_read_from_the_xml(tmp_path):
    skipping = SKIPPING.replace("this CPU has no AMX tiles", "no GPU").replace("test_a", "test_b")
    code, report = _pytest_junit(tmp_path, "def test_a():\n    pass\n" + skipping)
    assert code == 0
    verdict = judge("kernel-tests", report)
    assert verdict.state is State.FAIL and verdict.reason.endswith("1x 'no GPU'")


# ---------------------------------------------------------------- command line


def test_the_command_prints_one_line_and_exits_with_the_state(tmp_path, capsys):
    path = _write(tmp_path, _repack_run(_repack_case("compact50", False)))
    assert main(["repack", str(path)]) == 1
    assert capsys.readouterr().out.count("\n") == 1
    assert main(["repack", str(_write(tmp_path, _repack_run(_repack_case("a", True))))]) == 0
    assert main(["kernel-tests", str(tmp_path / "absent.xml")]) == 1
    with pytest.raises(SystemExit):
        main(["speed", str(path)])
    assert sorted(KINDS) == sorted(
        ["kernel-tests", "engine-tests", "repack", "repack-variants", "scores",
         "fused-scores", "cuda-graph", "runner-harness"]
    )  # fmt: skip
