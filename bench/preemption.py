"""`vtoken bench preemption`: a KV pool too small for its requests, three engines.

The same ``--requests`` natural-text prompts of ``--prompt-tokens`` tokens, submitted
together, each generating ``--new-tokens`` tokens greedily, on a pool of ``--num-blocks``
32-token blocks (too few for all of them at once without eviction), with:

- ``vanilla``: vLLM without a vToken config (it preempts and later recomputes requests);
- ``eager``: vToken, ``--policy`` (H2O by default) at ``--keep`` evicting every request to
  its budget every step;
- ``on_demand``: vToken, the same policy, evicting running requests only when the next step
  or the head of the waiting queue needs blocks, instead of vLLM preempting one; when
  even their budgets do not fit, below them, down to their floors (``squeeze_below_budget``);
- ``on_demand_at_budget``: the same, stopping at the budgets (vLLM preempts from there).

Per engine: ``preemptions`` and ``recomputed_tokens`` (the computed tokens a preempted
request loses and must recompute), ``evictions_under_pressure`` (request-steps squeezed,
``on_demand``), ``evictions_below_budget`` (those squeezed under their budgets),
``scored_request_steps`` (request-steps whose attention statistics were computed: on
demand, only where a step may end in an eviction, or every step for a policy whose
statistics accumulate, such as H2O), ``completed`` requests, ``tokens_per_s`` (generated
tokens over the wall time of the run), and the mean live tokens per request at the end
(how much each engine evicted: what the speed costs in kept context). One process, engines
one after another.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bench.common import PROMPT_TOPICS, csv_items, model_prompts, score_layer_ids, write_json

ENGINES = ("vanilla", "eager", "on_demand", "on_demand_at_budget")
if TYPE_CHECKING:
    from workers.config import ScoreLayers

BLOCK_SIZE = 32


@dataclass(frozen=True, slots=True)
class Row:
    engine: str
    preemptions: int
    recomputed_tokens: int
    evictions_under_pressure: int
    evictions_below_budget: int
    scored_request_steps: int
    completed: int
    tokens_per_s: float
    mean_live_tokens_at_end: float | None


class PreemptionCounter:
    """Counts vLLM's preemptions of one in-process engine (wraps its scheduler's
    ``_preempt_request`` on the instance) and the computed tokens they throw away."""

    def __init__(self, scheduler: Any) -> None:
        self.preemptions = 0
        self.recomputed_tokens = 0
        original = scheduler._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.preemptions += 1
            self.recomputed_tokens += int(request.num_computed_tokens)
            return original(request, *args, **kwargs)

        scheduler._preempt_request = counting


def engine_vtoken(
    engine: str, policy: str, keep: float, score_layers: ScoreLayers = "all"
) -> dict[str, Any] | None:
    """The ``additional_config["vtoken"]`` of one of ``ENGINES`` (``None``: vanilla)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "vanilla":
        return None
    return {
        "policy": policy,
        "keep_ratio": keep,
        "eviction": "eager" if engine == "eager" else "on_demand",
        "squeeze_below_budget": engine == "on_demand",
        "score_layers": score_layers,
    }


def record_live_at_end(state: Any) -> list[int]:
    """A list that fills with each finished request's live tokens as ``state`` (a
    ``VTokenScheduler``, or ``None`` for vanilla: the list stays empty) frees it."""
    live_at_end: list[int] = []
    if state is not None:
        original_free, running = state.free, state.manager.requests

        def free(request_id: str, preempted: bool = False) -> None:
            if not preempted:
                live_at_end.append(running[request_id].table.num_live)
            original_free(request_id, preempted)

        state.free = free
    return live_at_end


def run_engine(
    path: str,
    engine: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    keep: float,
    policy: str = "h2o",
    score_layers: ScoreLayers = "all",
    **engine_args: Any,
) -> Row:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.engine import engine_scheduler, engine_state, make_llm

    llm = make_llm(
        path,
        engine_vtoken(engine, policy, keep, score_layers),
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_model_len=len(prompts[0]) + new_tokens + BLOCK_SIZE,
        max_num_seqs=len(prompts),
        **engine_args,
    )
    counter = PreemptionCounter(engine_scheduler(llm))
    state = engine_state(llm)
    live_at_end = record_live_at_end(state)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = Row(
        engine=engine,
        preemptions=counter.preemptions,
        recomputed_tokens=counter.recomputed_tokens,
        evictions_under_pressure=state.num_evictions_under_pressure if state else 0,
        evictions_below_budget=state.num_evictions_below_budget if state else 0,
        scored_request_steps=state.counters.num_scored_request_steps if state else 0,
        completed=sum(o.finished for o in outputs),
        tokens_per_s=round(generated / elapsed, 2),
        mean_live_tokens_at_end=round(sum(live_at_end) / len(live_at_end), 1)
        if live_at_end
        else None,
    )
    del llm, state
    gc.collect()  # the engine's shutdown must finish before the next one starts
    return row


def cli(
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    num_blocks: Annotated[int, typer.Option(min=4, help="KV pool size, 32-token blocks.")] = 64,
    requests: Annotated[int, typer.Option(min=1)] = 16,
    prompt_tokens: Annotated[int, typer.Option(min=32)] = 256,
    new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    keep: Annotated[float, typer.Option(min=0.01, max=1.0, help="The policy's keep ratio.")] = 0.5,
    policy: Annotated[
        str, typer.Option(help="An eviction policy that holds its budget every step.")
    ] = "h2o",
    engines: Annotated[
        str, typer.Option(help="Comma-separated subset of " + ",".join(ENGINES))
    ] = ",".join(ENGINES),
    score_layers: Annotated[
        str,
        typer.Option(
            help="Layers that feed the scores: all, spread:N, or ids and ranges (0-29/3)."
        ),
    ] = "all",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Preemptions and throughput on a pool too small for its requests."""
    chosen = tuple(csv_items(engines))
    if not chosen or set(chosen) - set(ENGINES):
        raise typer.BadParameter(f"engines must be among {ENGINES}, got {engines!r}")
    from policies import make_policy

    try:
        if not make_policy(policy).holds_budget_every_step:
            raise typer.BadParameter(f"policy {policy!r} does not evict to a budget every step")
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    layers = score_layer_ids(score_layers)
    path, topics = model_prompts(model, len(PROMPT_TOPICS), prompt_tokens)
    prompts = [topics[i % len(topics)] for i in range(requests)]
    rows = []
    for engine in chosen:
        row = run_engine(path, engine, prompts, num_blocks, new_tokens, keep, policy, layers)
        typer.echo(json.dumps(asdict(row)))
        rows.append(row)
    if json_path is not None:
        document = {
            "model": model,
            "block_size": BLOCK_SIZE,
            "num_blocks": num_blocks,
            "requests": requests,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "policy": policy,
            "keep": keep,
            "score_layers": layers,
            "rows": [asdict(r) for r in rows],
        }
        write_json(json_path, document)
