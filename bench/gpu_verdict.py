"""The verdict of a GPU-check stage, read from what the stage wrote: ``bench/gpu_check.sh``
and ``bench/gpu_engine_check.sh`` run it after each benchmark or test run, so a stage
passes when its figures say so, not merely when its command exits 0.

    python -m bench.gpu_verdict KIND PATH

prints one line (why) and exits 0 (PASS), 1 (FAIL) or 3 (NOT RUN: a test run in which no
test ran, none collected or every one skipped). KIND, what PATH holds and what passes:

- ``kernel-tests``: pytest's JUnit XML; no failure or error, at least one test passed,
  and every skip for a reason in ``KERNEL_SKIPS_ON_CUDA`` (the CPU-only kernel tests and
  those needing vLLM skip on a bare CUDA machine; any other skip, e.g. Triton unusable,
  fails);
- ``engine-tests``: the same, and no test skipped;
- ``repack`` (``vtoken bench repack``), ``repack-variants`` (a JSON list of such runs),
  ``scores``: every case with a target met it (``target_met``), at least one case judged;
- ``fused-scores``: the same, and every case's ``max_abs_diff`` within the run's
  ``max_abs_diff_tolerance``;
- ``cuda-graph``: every round's replay equal to eager (``max_abs_diff`` 0) and within
  ``live_attention_tolerance`` of attention over the live tokens;
- ``runner-harness``: every step of the fenced run below ``tolerance``, and the negative
  control (no fence) at or above it in some step (else the harness cannot see a missing
  fence).

A document that is missing, unreadable or lacks a field fails, saying so. Only the
standard library: it runs wherever the GPU check does (torch and Triton, nothing else).
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_NAMED_CASES = 3  # the reason line names at most this many failing cases
CASE_LABEL_KEYS = (
    "shape", "kv_cache_layout", "dtype", "block_size", "pattern", "batch", "seq_len", "q_len",
)  # fmt: skip
CASE_FIGURE_KEYS = ("ratio", "device_ratio")
# Why a kernel test may skip on a CUDA machine with torch and Triton but no vLLM (the skip
# messages pytest records, matched at their start): a CPU-only test, or one that needs vLLM.
KERNEL_SKIPS_ON_CUDA = (
    "this CPU has no AMX tiles",
    "the probe runs vLLM's kernel under the Triton interpreter",
    "could not import 'vllm",  # pytest.importorskip
    "vLLM is not installed",
    "not the CPU build of vLLM",
)


class State(enum.Enum):
    """A stage's state; the value is the exit status."""

    PASS = 0
    FAIL = 1
    NOT_RUN = 3


@dataclass(frozen=True, slots=True)
class Verdict:
    state: State
    reason: str  # one line


class DocumentError(ValueError):
    """The document lacks what its kind must hold."""


def _field(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        raise DocumentError(f"{where} has no {key!r}")
    return mapping[key]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DocumentError(f"{where} is {value!r}, not a number")
    return float(value)


def _numbers(value: Any, where: str) -> list[float]:
    if not isinstance(value, list):
        raise DocumentError(f"{where} is {value!r}, not a list")
    return [_number(item, where) for item in value]


def _worst(errors: list[float]) -> float:
    """The largest error; NaN if any is NaN."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _within(value: float, tolerance: float) -> bool:
    """``value < tolerance``; NaN is never within."""
    return not math.isnan(value) and value < tolerance


# ---------------------------------------------------------------- test runs


@dataclass(frozen=True, slots=True)
class JunitCounts:
    tests: int
    failures: int
    errors: int
    skipped: int

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped


def junit_counts(path: Path) -> JunitCounts:
    """The totals of every ``<testsuite>`` of pytest's JUnit XML (``--junitxml``)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise DocumentError("no <testsuite> element")
    totals = {name: 0 for name in ("tests", "failures", "errors", "skipped")}
    for suite in suites:
        for name in totals:
            text = suite.get(name, "0")
            if not text.isdigit():
                raise DocumentError(f"<testsuite {name}={text!r}> is not a count")
            totals[name] += int(text)
    return JunitCounts(**totals)


def junit_verdict(counts: JunitCounts, allow_skips: bool) -> Verdict:
    if counts.failures or counts.errors:
        return Verdict(
            State.FAIL,
            f"{counts.failures} failed, {counts.errors} errors of {counts.tests} tests",
        )
    if counts.tests == 0:
        return Verdict(State.NOT_RUN, "no test collected")
    if counts.passed <= 0:
        return Verdict(State.NOT_RUN, f"0 passed: all {counts.tests} tests skipped")
    if counts.skipped and not allow_skips:
        return Verdict(State.FAIL, f"{counts.skipped} of {counts.tests} tests skipped")
    return Verdict(State.PASS, f"{counts.passed} passed, {counts.skipped} skipped")


def junit_skip_messages(path: Path) -> list[str]:
    """The message of every skipped ``<testcase>`` of pytest's JUnit XML."""
    root = ElementTree.parse(path).getroot()
    return [skipped.get("message", "") for skipped in root.iter("skipped")]


def kernel_tests_verdict(path: Path) -> Verdict:
    """``junit_verdict`` with skips allowed, then every skip's reason among
    ``KERNEL_SKIPS_ON_CUDA``."""
    counts = junit_counts(path)
    verdict = junit_verdict(counts, allow_skips=True)
    if verdict.state is not State.PASS:
        return verdict
    messages = junit_skip_messages(path)
    if len(messages) != counts.skipped:
        raise DocumentError(f"{counts.skipped} tests skipped but {len(messages)} <skipped>")
    unexpected = Counter(m for m in messages if not m.startswith(KERNEL_SKIPS_ON_CUDA))
    if unexpected:
        named = _named([f"{count}x {message!r}" for message, count in unexpected.most_common()])
        return Verdict(
            State.FAIL,
            f"{unexpected.total()} of {counts.tests} tests skipped for a reason not expected "
            f"on a CUDA machine: {named}",
        )
    return verdict


# ---------------------------------------------------------------- benchmarks


def case_label(case: dict[str, Any]) -> str:
    """``shape=llama8b block_size=16 pattern=compact50 ratio=0.48``: what names a case and
    its figures, of the keys it has."""
    keys = [*CASE_LABEL_KEYS, *CASE_FIGURE_KEYS]
    return " ".join(f"{key}={case[key]}" for key in keys if key in case)


def _cases(runs: list[Any]) -> list[dict[str, Any]]:
    cases = []
    for index, run in enumerate(runs):
        run_cases = _field(run, "cases", f"run {index}")
        if not isinstance(run_cases, list):
            raise DocumentError(f"run {index}'s cases are {run_cases!r}, not a list")
        for case in run_cases:
            if not isinstance(case, dict):
                raise DocumentError(f"run {index} has a case {case!r}, not an object")
            cases.append(case)
    return cases


def _named(descriptions: list[str]) -> str:
    named = "; ".join(descriptions[:MAX_NAMED_CASES])
    return named + ("; ..." if len(descriptions) > MAX_NAMED_CASES else "")


def _over_tolerance(runs: list[Any], tolerance_field: str) -> list[str]:
    """The cases whose ``max_abs_diff`` passes their run's ``tolerance_field`` (or is NaN)."""
    over = []
    for index, run in enumerate(runs):
        tolerance = _number(_field(run, tolerance_field, f"run {index}"), tolerance_field)
        for case in _cases([run]):
            label = case_label(case)
            diff = _number(_field(case, "max_abs_diff", label), f"{label}: max_abs_diff")
            if not diff <= tolerance:
                over.append(f"{label}: max_abs_diff {diff} > {tolerance}")
    return over


def targets_verdict(runs: list[Any], tolerance_field: str | None = None) -> Verdict:
    """Every case's ``target_met`` (``None``: no target for that case) and, with
    ``tolerance_field``, its ``max_abs_diff`` against the run's tolerance."""
    cases = _cases(runs)
    if not cases:
        return Verdict(State.FAIL, "no case ran")
    checked = ""
    if tolerance_field is not None:
        over = _over_tolerance(runs, tolerance_field)
        if over:
            return Verdict(State.FAIL, f"{len(over)} of {len(cases)} cases wrong: {_named(over)}")
        checked = f", every max_abs_diff within {runs[0][tolerance_field]}"
    verdicts = [_field(case, "target_met", case_label(case)) for case in cases]
    if not all(value is None or isinstance(value, bool) for value in verdicts):
        raise DocumentError(f"target_met must be true, false or null, got {verdicts}")
    judged = [case for case, met in zip(cases, verdicts, strict=True) if met is not None]
    missed = [case_label(case) for case, met in zip(cases, verdicts, strict=True) if met is False]
    target = runs[0].get("target") if isinstance(runs[0], dict) else None
    if not judged:
        return Verdict(State.FAIL, f"no case was judged against a target ({target})")
    if missed:
        return Verdict(
            State.FAIL,
            f"{len(missed)} of {len(judged)} cases miss the target ({target}): {_named(missed)}",
        )
    return Verdict(State.PASS, f"{len(judged)} of {len(judged)} cases meet the target{checked}")


def _load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _runs(document: Any, listed: bool) -> list[Any]:
    if not listed:
        return [document]
    if not isinstance(document, list) or not document:
        raise DocumentError("expected a non-empty list of runs")
    return document


def cuda_graph_verdict(document: Any) -> Verdict:
    tolerance = _number(
        _field(document, "live_attention_tolerance", "the run"), "live_attention_tolerance"
    )
    rounds = _field(document, "rounds", "the run")
    if not isinstance(rounds, list) or not rounds:
        return Verdict(State.FAIL, "no round ran")
    worst = 0.0
    for index, round_ in enumerate(rounds):
        eager = _number(_field(round_, "max_abs_diff", f"round {index}"), "max_abs_diff")
        live = _number(
            _field(round_, "max_abs_diff_vs_live_attention", f"round {index}"),
            "max_abs_diff_vs_live_attention",
        )
        if eager != 0.0:
            return Verdict(State.FAIL, f"round {index}: replay differs from eager by {eager}")
        if not _within(live, tolerance):
            return Verdict(
                State.FAIL,
                f"round {index}: replay differs from attention over the live tokens by "
                f"{live} (tolerance {tolerance})",
            )
        worst = max(worst, live)
    return Verdict(
        State.PASS,
        f"{len(rounds)} rounds: replay equals eager; live attention within {worst:.1e} "
        f"(< {tolerance})",
    )


def runner_harness_verdict(document: Any) -> Verdict:
    tolerance = _number(_field(document, "tolerance", "the run"), "tolerance")
    fenced = _numbers(
        _field(_field(document, "fenced", "the run"), "max_errors", "fenced"), "max_errors"
    )
    control = _numbers(
        _field(
            _field(document, "negative_control_unfenced", "the run"),
            "max_errors",
            "negative_control_unfenced",
        ),
        "max_errors",
    )
    if not fenced or not control:
        return Verdict(State.FAIL, "a run recorded no step")
    for step, error in enumerate(fenced):
        if not _within(error, tolerance):
            return Verdict(State.FAIL, f"fenced run, step {step}: error {error} >= {tolerance}")
    if all(_within(error, tolerance) for error in control):
        return Verdict(
            State.FAIL,
            f"the negative control (no fence) did not fail: every step within {tolerance} "
            f"(max {_worst(control):.1e}), so the harness cannot see a missing fence",
        )
    return Verdict(
        State.PASS,
        f"fenced max error {max(fenced):.1e} < {tolerance}; the negative control failed "
        f"(max error {_worst(control):.1e})",
    )


KINDS: dict[str, Callable[[Path], Verdict]] = {
    "kernel-tests": kernel_tests_verdict,
    "engine-tests": lambda path: junit_verdict(junit_counts(path), allow_skips=False),
    "repack": lambda path: targets_verdict(_runs(_load_json(path), listed=False)),
    "repack-variants": lambda path: targets_verdict(_runs(_load_json(path), listed=True)),
    "scores": lambda path: targets_verdict(_runs(_load_json(path), listed=False)),
    "fused-scores": lambda path: targets_verdict(
        _runs(_load_json(path), listed=False), tolerance_field="max_abs_diff_tolerance"
    ),
    "cuda-graph": lambda path: cuda_graph_verdict(_load_json(path)),
    "runner-harness": lambda path: runner_harness_verdict(_load_json(path)),
}


def judge(kind: str, path: Path) -> Verdict:
    """``KINDS[kind]`` of ``path``; a document that cannot be read or lacks a field fails
    with the reason. An unknown ``kind`` raises ``ValueError``."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    try:
        return KINDS[kind](path)
    except OSError as error:
        return Verdict(State.FAIL, f"{path}: {error.strerror or error}")
    except (ValueError, ElementTree.ParseError) as error:  # JSON, XML, DocumentError
        return Verdict(State.FAIL, f"{path}: {error}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    verdict = judge(args.kind, args.path)
    print(" ".join(verdict.reason.split()))  # one line, whatever a message held
    return verdict.state.value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
