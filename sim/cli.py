"""`vtoken sim ...`: the cluster simulator's commands (wired by ``serving/cli.py``)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import csv_floats, csv_items, write_json
from sim.cluster import FIDELITIES
from sim.cost_model import DEVICES, MODELS, gpu_cost_model
from sim.experiment import ENGINES, Case, Deployment, gpu_deployment, run_case
from sim.fast_replica import FAST_ENGINES, FAST_POLICIES, HELD_FRACTION, MEASURED_AT
from sim.routing import ROUTERS
from sim.workloads import KINDS

CPU = "cpu"
MODEL_HELP = f"{', '.join(MODELS)}; with --gpu cpu, a shipped model or folder"
GPU_HELP = f"{', '.join(DEVICES)}, or cpu (a fitted profile)"
BUDGET_HELP = "Per-tenant active-KV budget in blocks (admission); default: none."
BLOCKS_HELP = "KV blocks per replica (default: from the GPU's memory)."
DRAIN_HELP = (
    "Virtual seconds after the last arrival before unfinished requests count as SLO"
    " misses (default: twice the last arrival's time, plus 1)."
)
FIDELITY_HELP = (
    "exact: vLLM's scheduler with vToken per replica; fast: block counts (up to 1,000"
    " replicas, sim/fast_replica.py)."
)
PROFILE_HELP = "With --gpu cpu: a profile written by `vtoken sim fit-cpu`."


def _ints(value: str, option: str) -> list[int]:
    try:
        numbers = [int(v) for v in csv_items(value)]
    except ValueError:
        raise typer.BadParameter(
            f"{option} takes comma-separated integers, got {value!r}"
        ) from None
    if not numbers or min(numbers) < 0:
        raise typer.BadParameter(f"{option} takes non-negative integers, got {value!r}")
    return numbers


def _choices(value: str, allowed: tuple[str, ...], option: str) -> list[str]:
    chosen = csv_items(value)
    if not chosen or set(chosen) - set(allowed):
        raise typer.BadParameter(f"{option} must be among {', '.join(allowed)}, got {value!r}")
    return chosen


def _deployment(
    model: str, gpu: str, dtype: str, tp: int, policy: dict[str, Any], fields: dict[str, Any],
    cpu_profile: Path | None,
) -> Deployment:  # fmt: skip
    if gpu == CPU:
        from sim.cpu_profile import CpuCostModel
        from workers.models import resolve_model

        if cpu_profile is None or fields.get("num_blocks") is None:
            raise typer.BadParameter("--gpu cpu needs --cpu-profile and --num-blocks")
        profile = CpuCostModel.from_json(cpu_profile)
        defaults = {
            "duration_s": 60.0, "num_tenants": 8, "block_size": 32, "max_model_len": 2048,
            "max_num_seqs": 64, "max_num_batched_tokens": 2048, "length_scale": 0.1,
        }  # fmt: skip
        settings = defaults | {k: v for k, v in fields.items() if v is not None}
        folder = str(resolve_model(model))
        return Deployment(model, CPU, profile, policy, model_dir=folder, **settings)
    try:
        cost = gpu_cost_model(gpu, model, dtype, tp)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    return gpu_deployment(cost, model, gpu, policy, **{k: v for k, v in fields.items() if v})


def cluster(
    json_path: Annotated[Path, typer.Option("--json", help="Append JSONL rows here.")],
    replicas: Annotated[str, typer.Option(help="Comma-separated replica counts.")] = "2",
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help=GPU_HELP)] = "h200",
    dtype: Annotated[str, typer.Option(help="bf16 or fp8 (weights and KV cache)")] = "bf16",
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel GPUs per replica.")] = 1,
    workload: Annotated[str, typer.Option(help=", ".join(KINDS))] = "chat",
    engines: Annotated[str, typer.Option(help=", ".join(ENGINES))] = ",".join(ENGINES),
    routers: Annotated[str, typer.Option(help=", ".join(ROUTERS))] = "project",
    rates: Annotated[str, typer.Option(help="Arrival rates (requests/s, whole cluster).")] = "4",
    seeds: Annotated[str, typer.Option(help="Comma-separated workload seeds.")] = "0",
    duration: Annotated[float, typer.Option(min=1.0, help="Virtual seconds of arrivals.")] = 60.0,
    tenants: Annotated[int, typer.Option(min=1)] = 8,
    policy: Annotated[str, typer.Option(help="The engines' eviction policy.")] = "h2o",
    keep: Annotated[float, typer.Option(min=0.01, max=1.0)] = 0.2,
    tenant_budget_blocks: Annotated[int | None, typer.Option(help=BUDGET_HELP)] = None,
    num_blocks: Annotated[int | None, typer.Option(help=BLOCKS_HELP)] = None,
    cpu_profile: Annotated[Path | None, typer.Option(help=PROFILE_HELP)] = None,
    drain_s: Annotated[float | None, typer.Option(min=0.0, help=DRAIN_HELP)] = None,
    fidelity: Annotated[str, typer.Option(help=FIDELITY_HELP)] = "exact",
) -> None:  # fmt: skip
    """Simulate serving on N replicas (vLLM's scheduler with vToken, virtual time):
    one JSONL row per (engine, router, replicas, workload, rate, seed)."""
    chosen_engines = _choices(engines, ENGINES, "--engines")
    chosen_routers = _choices(routers, ROUTERS, "--routers")
    kinds = _choices(workload, KINDS, "--workload")
    if fidelity not in FIDELITIES:
        raise typer.BadParameter(f"--fidelity must be one of {', '.join(FIDELITIES)}")
    if fidelity == "fast" and set(chosen_engines) - set(FAST_ENGINES):
        raise typer.BadParameter(f"--fidelity fast runs {', '.join(FAST_ENGINES)}")
    if gpu != CPU and gpu not in DEVICES:
        raise typer.BadParameter(f"--gpu must be among {', '.join(DEVICES)}, cpu; got {gpu!r}")
    counts, seed_list = _ints(replicas, "--replicas"), _ints(seeds, "--seeds")
    if min(counts) < 1:
        raise typer.BadParameter("--replicas must be >= 1")
    rate_list = csv_floats(rates, "--rates")
    if not rate_list or min(rate_list) <= 0:
        raise typer.BadParameter("--rates must be positive")
    fields = {
        "duration_s": duration,
        "num_tenants": tenants,
        "num_blocks": num_blocks,
        "tenant_budget_blocks": tenant_budget_blocks,
        "drain_s": drain_s,
        "fidelity": fidelity,
    }
    deployment = _deployment(
        model, gpu, dtype, tp, {"policy": policy, "keep_ratio": keep}, fields, cpu_profile
    )
    measured = {"policy": policy, "keep_ratio": keep, "block_size": deployment.block_size}
    held_share = set(chosen_engines) & set(HELD_FRACTION)
    if fidelity == "fast" and held_share and measured != MEASURED_AT:
        raise typer.BadParameter(
            f"--fidelity fast runs {', '.join(sorted(held_share))} on a share of vanilla's "
            f"blocks measured at {MEASURED_AT}, not {measured}: leave them out or use "
            "--fidelity exact"
        )
    if fidelity == "fast" and policy not in FAST_POLICIES:
        raise typer.BadParameter(f"--fidelity fast does not model policy {policy!r}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for combo in itertools.product(
        chosen_engines, chosen_routers, counts, kinds, rate_list, seed_list
    ):
        row = run_case(Case(*combo), deployment)
        with json_path.open("a") as out:
            out.write(json.dumps(row) + "\n")
        typer.echo(
            f"{combo}: goodput {row['goodput_rps']} req/s, attainment {row['slo_attainment']},"
            f" preemptions {row['preemptions']}, hit share {row['hit_share_of_ideal']}"
        )


def fit_cpu(
    json_path: Annotated[Path, typer.Option("--json", help="Write the profile here.")],
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    num_blocks: Annotated[int, typer.Option(min=4)] = 64,
    requests: Annotated[int, typer.Option(min=1)] = 16,
    prompt_tokens: Annotated[int, typer.Option(min=32)] = 256,
    new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    keep: Annotated[float, typer.Option(min=0.01, max=1.0)] = 0.5,
    policy: Annotated[str, typer.Option()] = "h2o",
    engines: Annotated[str, typer.Option()] = "vanilla,eager,on_demand",
) -> None:
    """Fit a CPU step-time profile to the timed steps of real CPU engines running
    ``bench preemption``'s workload."""
    from bench.common import PROMPT_TOPICS, model_prompts
    from bench.preemption import ENGINES as PREEMPTION_ENGINES
    from sim.cpu_profile import fit_from_preemption_runs

    chosen = _choices(engines, PREEMPTION_ENGINES, "--engines")
    path, topics = model_prompts(model, len(PROMPT_TOPICS), prompt_tokens)
    prompts = [topics[i % len(topics)] for i in range(requests)]
    profile = fit_from_preemption_runs(path, prompts, num_blocks, new_tokens, keep, policy, chosen)
    profile.to_json(json_path)
    typer.echo(f"{profile.num_samples} steps, R^2 {profile.r_squared}: {profile.coefficients}")


GATES = ("exact_counts", "fast", "gpu_tables")
GPU_ROWS_HELP = "GPU tables gate: only rows of these {} (default: every published row)."
GPU_REQUESTS_HELP = "GPU tables gate: requests per row (default: the source's count)."


def validate(
    json_path: Annotated[Path, typer.Option("--json", help="Write the gates here.")],
    gates: Annotated[str, typer.Option(help=", ".join(GATES))] = ",".join(GATES),
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    requests: Annotated[int, typer.Option(min=2)] = 8,
    prompt_tokens: Annotated[int, typer.Option(min=32)] = 128,
    new_tokens: Annotated[int, typer.Option(min=1)] = 48,
    num_blocks: Annotated[int, typer.Option(min=4)] = 24,
    fast_engines: Annotated[str, typer.Option(help="Fast gate.")] = "vanilla,eager,on_demand",
    fast_replicas: Annotated[int, typer.Option(min=1, help="Fast gate: replicas.")] = 8,
    fast_rate: Annotated[float, typer.Option(min=0.1, help="Fast gate: requests/s.")] = 40.0,
    fast_duration: Annotated[float, typer.Option(min=1.0, help="Fast gate: seconds.")] = 10.0,
    fast_blocks: Annotated[int, typer.Option(min=16, help="Fast gate: blocks/replica.")] = 1024,
    fast_seed: Annotated[int, typer.Option(min=0, help="Fast gate: workload seed.")] = 0,
    gpu_models: Annotated[str | None, typer.Option(help=GPU_ROWS_HELP.format("models"))] = None,
    gpu_gpus: Annotated[str | None, typer.Option(help=GPU_ROWS_HELP.format("GPUs"))] = None,
    gpu_shapes: Annotated[str | None, typer.Option(help=GPU_ROWS_HELP.format("ISL/OSL"))] = None,
    gpu_requests: Annotated[int | None, typer.Option(min=1, help=GPU_REQUESTS_HELP)] = None,
    gpu_fidelity: Annotated[str, typer.Option(help="GPU tables gate: fast or exact.")] = "fast",
) -> None:  # fmt: skip
    """Run the gates that exist: (a) exact counts against real CPU engines; the fast
    mode against exact mode (chat, Llama-3.1-8B on H200, project router); (c) the GPU
    step-time model against published serving throughput (sim/published.py); (b) is
    reported as not built."""
    chosen = _choices(gates, GATES, "--gates")
    document: dict[str, Any] = {"gates": {}}
    failed = False
    if "exact_counts" in chosen:
        from sim.validate import exact_counts_gate

        gate = exact_counts_gate(model, requests, prompt_tokens, new_tokens, num_blocks)
        document["gates"]["exact_counts"] = gate
        typer.echo(f"exact_counts: passed={gate['passed']} ({len(gate['rows'])} rows)")
        failed |= not gate["passed"]
    if "fast" in chosen:
        from sim.fast_gate import METRICS, fast_gate

        engines = _choices(fast_engines, FAST_ENGINES, "--fast-engines")
        fields = {"duration_s": fast_duration, "num_blocks": fast_blocks}
        deployment = _deployment(
            "llama-3.1-8b", "h200", "bf16", 1, {"policy": "h2o", "keep_ratio": 0.2}, fields,
            None,
        )  # fmt: skip
        cases = [Case(e, "project", fast_replicas, "chat", fast_rate, fast_seed) for e in engines]
        gate = fast_gate(deployment, cases)
        document["gates"]["fast_vs_exact"] = gate
        for row in gate["rows"]:
            figures = ", ".join(
                f"{m} {row['metrics'][m]['exact']}/{row['metrics'][m]['fast']}" for m in METRICS
            )
            typer.echo(f"fast {row['engine']}: passed={row['passed']} (exact/fast: {figures})")
        failed |= not gate["passed"]
    if "gpu_tables" in chosen:
        gate = _gpu_tables(gpu_models, gpu_gpus, gpu_shapes, gpu_requests, gpu_fidelity)
        document["gates"]["gpu_published"] = gate
        failed |= not gate["passed"]
    else:
        document["gates"]["gpu_published"] = {"passed": None, "status": "not run"}
    document["gates"]["cpu_holdout"] = {"passed": None, "status": "not built"}
    write_json(json_path, document)
    if failed:
        raise typer.Exit(1)


def _gpu_tables(
    models: str | None, gpus: str | None, shapes: str | None, requests: int | None,
    fidelity: str,
) -> dict[str, Any]:  # fmt: skip
    from sim.gpu_gate import gpu_tables_gate, select_rows

    if fidelity not in FIDELITIES:
        raise typer.BadParameter(f"--gpu-fidelity must be one of {', '.join(FIDELITIES)}")
    try:
        rows = select_rows(
            models=None if models is None else csv_items(models),
            gpus=None if gpus is None else csv_items(gpus),
            shapes=None if shapes is None else csv_items(shapes),
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    gate = gpu_tables_gate(rows, requests, fidelity)
    for row in gate["rows"]:
        typer.echo(
            f"gpu {row['row']}: published {row['published_tps_per_gpu']}, simulated "
            f"{row['simulated_tps_per_gpu']} tok/s/GPU, ratio {row['ratio']}, "
            f"within={row['within']}"
        )
    typer.echo(
        f"gpu_tables: passed={gate['passed']} ({gate['rows_within']} of {len(gate['rows'])}"
        f" rows within {gate['tolerance']:.0%}, max error {gate['max_rel_error']})"
    )
    return gate
