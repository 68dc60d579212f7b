"""A CPU step-time profile fitted from a real vLLM CPU engine's per-step timings.

``timing_steps`` wraps vLLM's ``Scheduler`` while open and times each step
from ``schedule()`` to the end of ``update_from_output()`` (scheduling, the forward,
vToken's evictions, vLLM's update: what ``workers.step_times.StepTimes`` times), with the
step's counts taken as an exact replica takes them (``sim.replica.step_counts``). The
profile is a non-negative least-squares fit (numpy only)

    seconds = base + per_request x requests + per_token x scheduled tokens
              + per_pair x attention pairs + per_scored x scored tokens + per_move x moves

On the CPU build every engine's attention reads its live tokens (Naive-Evict compacts as
vToken does; only block accounting differs), so the fit uses the step's pairs whatever
the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.cost_model import KVReads, StepCost
from sim.replica import StepRecord, step_counts
from workers.messages import OPS_ATTRIBUTE

FEATURES = (
    "num_requests",
    "scheduled_tokens",
    "attention_pairs",
    "scored_tokens",
    "num_moves",
)


def features(counts: dict[str, int] | StepRecord) -> list[float]:
    """``[1, *FEATURES]`` of one step."""

    def get(name: str) -> int:
        return int(counts[name] if isinstance(counts, dict) else getattr(counts, name))

    scheduled = get("prefill_tokens") + get("decode_tokens")
    return [
        1.0,
        float(get("num_requests")),
        float(scheduled),
        float(get("attention_pairs")),
        float(get("scored_tokens")),
        float(get("num_moves")),
    ]


@dataclass(frozen=True, slots=True)
class StepSample:
    counts: dict[str, int]
    seconds: float


@contextmanager
def timing_steps() -> Iterator[list[StepSample]]:
    """While open, every vLLM engine stepping in this process (its ``Scheduler``, with
    or without vToken) appends each step's ``StepSample`` to the yielded list."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from workers.plugin import register
    from workers.vllm_patches import scheduler_state

    register()  # vToken's wrappers first: restoring must not take them off
    samples: list[StepSample] = []
    original_schedule = Scheduler.schedule
    original_update = Scheduler.update_from_output
    started: dict[int, float] = {}

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        started[id(self)] = time.perf_counter()
        return original_schedule(self, *args, **kwargs)

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        scheduled = dict(scheduler_output.num_scheduled_tokens)
        ops = getattr(scheduler_output, OPS_ATTRIBUTE, None)
        counts = step_counts(self, scheduler_state(self), scheduled, ops)
        result = original_update(self, scheduler_output, model_runner_output)
        began = started.pop(id(self), None)
        if scheduled and began is not None:
            samples.append(StepSample(counts, time.perf_counter() - began))
        return result

    Scheduler.schedule = schedule  # type: ignore[method-assign]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    try:
        yield samples
    finally:
        Scheduler.schedule = original_schedule  # type: ignore[method-assign]
        Scheduler.update_from_output = original_update  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class CpuCostModel:
    """The fitted profile: ``coefficients`` over ``[1, *FEATURES]`` (seconds)."""

    coefficients: tuple[float, ...]
    num_samples: int
    r_squared: float

    def step(self, record: StepRecord, reads: KVReads) -> StepCost:
        seconds = float(np.dot(self.coefficients, features(record)))
        return StepCost(seconds, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps({"features": ["base", *FEATURES], **asdict(self)}, indent=1))

    @classmethod
    def from_json(cls, path: Path) -> CpuCostModel:
        document = json.loads(path.read_text())
        if document.get("features") != ["base", *FEATURES]:
            raise ValueError(f"{path}: not a CPU profile of features {FEATURES}")
        return cls(tuple(document["coefficients"]), document["num_samples"], document["r_squared"])


def fit_cpu_profile(samples: Sequence[StepSample]) -> CpuCostModel:
    """Non-negative least squares over the samples (at least ``len(FEATURES) + 1``)."""
    if len(samples) <= len(FEATURES):
        raise ValueError(f"need more than {len(FEATURES)} timed steps, got {len(samples)}")
    x = np.array([features(s.counts) for s in samples])
    y = np.array([s.seconds for s in samples])
    scale = np.maximum(x.max(axis=0), 1e-12)  # columns of very different magnitudes
    coefficients = _non_negative_lstsq(x / scale, y) / scale
    residual = y - x @ coefficients
    total = float(((y - y.mean()) ** 2).sum()) or 1.0
    r_squared = 1.0 - float((residual**2).sum()) / total
    return CpuCostModel(tuple(float(c) for c in coefficients), len(samples), round(r_squared, 4))


def _non_negative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, drop the most negative column,
    repeat (a small active-set loop; six columns at most here)."""
    active = list(range(x.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if not active or solution.min() >= 0:
            break
        active.pop(int(np.argmin(solution)))
    coefficients = np.zeros(x.shape[1])
    coefficients[active] = solution
    return coefficients


def fit_from_preemption_runs(
    model_dir: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    keep: float,
    policy: str,
    engines: Sequence[str],
) -> CpuCostModel:
    """Run ``bench preemption``'s engines (``bench.preemption.run_engine``) on real CPU
    engines, time every step, and fit the profile to all of them together."""
    from bench.preemption import run_engine

    with timing_steps() as samples:
        for engine in engines:
            run_engine(
                model_dir, engine, prompts, num_blocks, new_tokens, keep, policy,
                skip_tokenizer_init=True,
            )  # fmt: skip
    return fit_cpu_profile(samples)
