"""Gate (c), ``gpu_tables``: the GPU step-time model against published serving throughput.

Each published row (``sim/published.py``: model, GPU, FP8, TP, ISL/OSL) runs as the source
ran it: one replica (the TP group) of the vanilla engine, every request queued at time 0,
each with exactly ISL distinct prompt tokens and OSL outputs; the simulated figure is the
output tokens over the time from 0 to the last completion, divided by TP (tokens/s per
GPU, as the published figure over its TP).

Engine settings, stated in the gate's output:

- KV pool: the cost model's ``kv_pool_blocks`` (90% of the TP group's memory less the
  weights: vLLM's ``gpu_memory_utilization`` default), block 16;
- ``max_num_batched_tokens`` 16,384 and ``max_num_seqs`` at most 1,024: vLLM 0.32's offline
  (``LLM`` class) defaults on H100 and H200 (``EngineArgs``,
  ``_set_default_max_num_seqs_and_batched_tokens_args``);
- ``max_num_seqs`` further capped at the requests whose whole sequence (ISL + OSL) fits the
  pool at once: the source's scheduler (``GUARANTEED_NO_EVICT``) starts a request only when
  all of it fits and never pauses one, while vLLM's admits on the prompt alone and preempts
  (recomputes) under pressure; the cap makes vLLM's scheduler admit as the source's did, so
  the gate compares step times, not preemption policies;
- prefix caching off: the source's prompts are random tokens, nothing is shared.

Rule: a row passes when ``|simulated - published| <= tolerance x published`` (15%); the
gate passes when every selected row does.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.cluster import ClusterSpec, run_cluster
from sim.cost_model import gpu_cost_model
from sim.model_configs import model_folder
from sim.published import ROWS, SOURCE, PublishedRow
from sim.replica import ReplicaConfig
from sim.workloads import SimRequest

TOLERANCE = 0.15
MAX_NUM_SEQS = 1024  # vLLM 0.32, offline defaults on H100 / H200 (module docstring)
MAX_NUM_BATCHED_TOKENS = 16_384
BLOCK_SIZE = 16
MEMORY_FRACTION = 0.9  # vLLM's gpu_memory_utilization default


@dataclass(frozen=True, slots=True)
class RowSettings:
    """What one row's replica runs with."""

    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_requests: int


def select_rows(
    rows: tuple[PublishedRow, ...] = ROWS,
    models: list[str] | None = None,
    gpus: list[str] | None = None,
    shapes: list[str] | None = None,
) -> list[PublishedRow]:
    """The published rows whose cost-model shape is in ``models`` (``llama-3.1-8b``...),
    GPU in ``gpus`` and ``ISL/OSL`` in ``shapes`` (``None``: any). A filter that matches no
    row of the table is an error (a typo must not make an empty, passing gate)."""
    chosen = list(rows)
    for name, wanted, field in (
        ("model", models, lambda r: r.shape),
        ("gpu", gpus, lambda r: r.gpu),
        ("ISL/OSL", shapes, lambda r: f"{r.isl}/{r.osl}"),
    ):
        if wanted is None:
            continue
        known = {field(r) for r in rows}
        unknown = sorted(set(wanted) - known)
        if unknown:
            raise ValueError(f"no published row has {name} {unknown}; known: {sorted(known)}")
        chosen = [r for r in chosen if field(r) in wanted]
    if not chosen:
        raise ValueError("the filters leave no published row")
    return chosen


def within(published: float, simulated: float, tolerance: float = TOLERANCE) -> bool:
    """The gate's rule for one row (module docstring)."""
    if published <= 0:
        raise ValueError(f"a published figure must be positive, got {published}")
    return abs(simulated - published) <= tolerance * published + 1e-9


def row_settings(row: PublishedRow, num_requests: int | None = None) -> RowSettings:
    """The replica's settings for ``row`` (module docstring); ``num_requests`` defaults to
    the source's count."""
    cost = gpu_cost_model(row.gpu, row.shape, row.dtype, row.tp, BLOCK_SIZE)
    blocks = cost.kv_pool_blocks(MEMORY_FRACTION)
    whole = math.ceil((row.isl + row.osl) / BLOCK_SIZE)
    fits = blocks // whole
    if fits < 1:
        raise ValueError(f"{row.key}: one sequence of {row.isl + row.osl} tokens does not fit")
    count = row.num_requests if num_requests is None else num_requests
    if count < 1:
        raise ValueError(f"num_requests must be >= 1, got {count}")
    return RowSettings(blocks, min(MAX_NUM_SEQS, fits), MAX_NUM_BATCHED_TOKENS, count)


def offline_requests(isl: int, osl: int, count: int) -> list[SimRequest]:
    """``count`` requests queued at time 0, ``isl`` prompt tokens and ``osl`` outputs each
    (prefix caching is off, so one token tuple serves them all)."""
    prompt = tuple((7 * i) % 30_000 + 1 for i in range(isl))
    outputs = tuple((11 * i) % 30_000 + 1 for i in range(osl))
    return [SimRequest(f"r{i}", "offline", i, 0, 0.0, prompt, outputs) for i in range(count)]


def simulate_row(
    row: PublishedRow, num_requests: int | None = None, fidelity: str = "fast",
    scratch: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Simulate ``row``; the simulated output tokens/s per GPU and what the run did."""
    settings = row_settings(row, num_requests)
    cost = gpu_cost_model(row.gpu, row.shape, row.dtype, row.tp, BLOCK_SIZE)
    folder = model_folder(row.shape, scratch or Path(tempfile.gettempdir()) / "vtoken-sim-models")
    replica = ReplicaConfig(
        folder,
        None,
        num_blocks=settings.num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=row.isl + row.osl,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    # drain_s: no horizon, every request finishes.
    spec = ClusterSpec(1, "vanilla", "round_robin", replica, 0, None, 1e12, fidelity)
    started = time.perf_counter()
    run = run_cluster(spec, cost, offline_requests(row.isl, row.osl, settings.num_requests))
    finishes = [t.finish_s for t in run.requests.values()]
    if any(f is None for f in finishes) or not finishes:
        raise RuntimeError(f"{row.key}: not every request finished")
    makespan = max(f for f in finishes if f is not None)
    outputs = settings.num_requests * row.osl
    simulated = outputs / makespan / row.tp
    return {
        "simulated_tps_per_gpu": round(simulated, 1),
        "makespan_s": round(makespan, 6),
        "steps": run.steps,
        "preemptions": sum(r.num_preemptions for r in run.replicas),
        "mean_step_s": {k: round(v / max(run.steps, 1), 6) for k, v in run.step_cost.items()},
        "settings": {
            "num_blocks": settings.num_blocks,
            "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "num_requests": settings.num_requests,
            "block_size": BLOCK_SIZE,
            "fidelity": fidelity,
        },
        "wall_s": round(time.perf_counter() - started, 2),
    }


def gpu_tables_gate(
    rows: list[PublishedRow], num_requests: int | None = None, fidelity: str = "fast",
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:  # fmt: skip
    """Run every row; per row the published and simulated figures (tokens/s per GPU), their
    ratio and whether it is within ``tolerance``."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    results = []
    for row in rows:
        measured = simulate_row(row, num_requests, fidelity)
        simulated = measured["simulated_tps_per_gpu"]
        results.append(
            {
                "row": row.key,
                "model": row.model,
                "gpu": row.gpu,
                "dtype": row.dtype,
                "tp": row.tp,
                "isl": row.isl,
                "osl": row.osl,
                "published_tps_per_gpu": round(row.per_gpu_tps, 1),
                "simulated_tps_per_gpu": simulated,
                "ratio": round(simulated / row.per_gpu_tps, 3),
                "within": within(row.per_gpu_tps, simulated, tolerance),
            }
            | {k: v for k, v in measured.items() if k != "simulated_tps_per_gpu"}
        )
    errors = [abs(r["ratio"] - 1) for r in results]
    return {
        "passed": all(r["within"] for r in results),
        "tolerance": tolerance,
        "rule": "|simulated - published| <= tolerance x published, per row",
        "source": SOURCE,
        "max_rel_error": round(max(errors), 3) if errors else None,
        "rows_within": sum(r["within"] for r in results),
        "rows": results,
    }
