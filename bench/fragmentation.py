"""`vtoken bench fragmentation`: blocks a request retains under eviction: naive, block
and vtoken.

Each run generates greedily on natural-text prompts (CPython's language reference, shipped
with Python) while a policy evicts down to ``keep * sequence length`` tokens every step.
One model run drives four managers in lock-step (vtoken and naive, block sizes 16 and 32)
with identical allocations and evictions, so every pair differs only in reclamation.
Block-granular eviction (``block``: whole lowest-scored blocks dropped, no repack) decides
differently, so it has a model run of its own per block size. Blocks are the mean per
request at the end of generation.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from bench.common import (
    PROMPT_TOPICS,
    model_prompts,
    natural_prompts,
    policy_names,
    pyplot,
    save_figure,
    write_json,
)

POLICIES = ("h2o", "random", "scissorhands", "tova", "snapkv", "streaming_llm", "page", "none")
KEEP_RATIOS = (0.2, 0.5)
BLOCK_SIZES = (16, 32)


class Engine(StrEnum):
    SIM = "sim"
    VLLM = "vllm"  # vLLM CPU with the vToken plugin; block size 32 only (CPU_ATTN)


@dataclass(frozen=True, slots=True)
class Row:
    policy: str
    keep: float
    block_size: int
    naive_blocks: float
    vtoken_blocks: float
    ideal_blocks: float
    reduction_pct: float  # vtoken vs naive
    block_blocks: float  # block-granular eviction (its own decisions)


def keep_budget(keep: float, num_tokens: int) -> int:
    """Live-token budget after a step: ``ceil(keep * sequence length)``."""
    return math.ceil(keep * num_tokens)


def run_sim(
    model: str,
    policies: list[str],
    keeps: list[float],
    block_sizes: list[int],
    num_prompts: int,
    prompt_tokens: int,
    new_tokens: int,
    progress: bool = True,
) -> list[Row]:
    from tqdm import tqdm

    from policies import make_policy
    from vtoken import ReclaimMode, StandaloneBlockPool, VTokenManager
    from workers.hf_sim import HFSimEngine
    from workers.models import resolve_model

    engine = HFSimEngine(str(resolve_model(model)))
    prompts = natural_prompts(engine.tokenizer, num_prompts, prompt_tokens)
    cases = [(p, k) for p in policies for k in keeps]
    totals: dict[tuple[str, float, int, str], float] = {}
    bar = tqdm(total=len(cases) * len(prompts), desc="fragmentation", disable=not progress)
    for policy_name, keep in cases:
        for index, prompt in enumerate(prompts):
            managers = {}
            for block_size in block_sizes:
                num_blocks = math.ceil((prompt_tokens + new_tokens) / block_size) + 2
                for mode in ReclaimMode:
                    pool = StandaloneBlockPool(num_blocks)
                    managers[(block_size, mode)] = VTokenManager(pool, block_size, mode)
            lock_step = [m for (_, mode), m in managers.items() if mode is not ReclaimMode.BLOCK]
            lock_step.sort(key=lambda manager: manager.mode is not ReclaimMode.VTOKEN)
            for primary in [lock_step] + [
                [m] for (_, mode), m in managers.items() if mode is ReclaimMode.BLOCK
            ]:
                engine.generate(
                    prompt,
                    new_tokens,
                    make_policy(policy_name),
                    partial(keep_budget, keep),
                    primary,
                    request_id=f"p{index}",
                )
            for (block_size, mode), manager in managers.items():
                report = manager.report(f"p{index}")
                values = {mode.value: report.allocated_blocks}
                if mode is ReclaimMode.VTOKEN:
                    values["ideal"] = report.ideal_blocks
                for kind, value in values.items():
                    key = (policy_name, keep, block_size, kind)
                    totals[key] = totals.get(key, 0.0) + value / len(prompts)
            bar.update()
    bar.close()
    return [
        make_row(
            policy_name, keep, block_size, partial(_total, totals, policy_name, keep, block_size)
        )
        for policy_name, keep in cases
        for block_size in block_sizes
    ]


def _total(totals: dict, *key: object) -> float:
    return totals[key]


def make_row(policy: str, keep: float, block_size: int, total: Callable[[str], float]) -> Row:
    """One row from the mean blocks of each kind (``total(kind)``)."""
    naive, vtoken, ideal, block = (total(k) for k in ("naive", "vtoken", "ideal", "block"))
    reduction = 100.0 * (1.0 - vtoken / naive) if naive else 0.0
    return Row(policy, keep, block_size, naive, vtoken, ideal, round(reduction, 2), block)


def run_vllm(
    model: str,
    policies: list[str],
    keeps: list[float],
    num_prompts: int,
    prompt_tokens: int,
    new_tokens: int,
    block_size: int = 32,
    max_num_seqs: int = 16,
) -> list[Row]:
    """The same cases served by vLLM with the plugin, once per mode (``vtoken``, ``naive``,
    ``block``).

    Every request carries its policy in ``extra_args["vtoken_policy"]``, so one engine per
    mode serves all cases; blocks are what each request held from vLLM's block pool when
    it finished (after its last repack). Prompts are never chunked (as in the reference
    engine) and ``max_num_seqs`` keeps the pool from preempting (a resumed request would
    start over); a run that preempted anyway raises.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.engine import engine_state, internal_request_id, make_llm

    path, prompts = model_prompts(model, num_prompts, prompt_tokens)
    cases = [(p, k) for p in policies for k in keeps for _ in prompts]
    totals: dict[tuple[str, float, str], float] = {}
    for mode in ("vtoken", "naive", "block"):
        llm = make_llm(
            path,
            {"policy": "none", "mode": mode},
            block_size=block_size,
            max_model_len=prompt_tokens + new_tokens + block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(2048, prompt_tokens),
            enable_chunked_prefill=False,
        )
        params = [
            SamplingParams(
                max_tokens=new_tokens,
                temperature=0,
                ignore_eos=True,
                extra_args={
                    "vtoken_policy": {"policy": p, "keep_ratio": None if p == "none" else k}
                },
            )
            for p, k in cases
        ]
        inputs = [
            TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]) for i in range(len(cases))
        ]
        outputs = llm.generate(inputs, params)
        state = engine_state(llm)
        assert state is not None
        if state.num_preemptions:
            raise RuntimeError(f"{mode}: {state.num_preemptions} preemptions; lower max_num_seqs")
        for (policy_name, keep), output in zip(cases, outputs, strict=True):
            report = state.finished[internal_request_id(state, output.request_id)].report
            values = {mode: report.allocated_blocks}
            if mode == "vtoken":
                values["ideal"] = report.ideal_blocks
            for kind, value in values.items():
                key = (policy_name, keep, kind)
                totals[key] = totals.get(key, 0.0) + value / len(prompts)
        del llm, state
        gc.collect()  # the next engine may start only after this one shut down
    return [
        make_row(policy_name, keep, block_size, partial(_total, totals, policy_name, keep))
        for policy_name in policies
        for keep in keeps
    ]


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in (
        "policy",
        "keep",
        "block",
        "naive blocks",
        "block blocks",
        "vtoken blocks",
        "ideal",
        "reduction",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in rows:
        table.add_row(
            row.policy,
            f"{row.keep:.1f}",
            str(row.block_size),
            f"{row.naive_blocks:.2f}",
            f"{row.block_blocks:.2f}",
            f"{row.vtoken_blocks:.2f}",
            f"{row.ideal_blocks:.2f}",
            f"{row.reduction_pct:.1f}%",
        )
    Console().print(table)


def plot(rows: list[Row], path: Path) -> None:
    plt = pyplot()
    labels = [f"{r.policy}\nk={r.keep} b={r.block_size}" for r in rows]
    xs = range(len(rows))
    figure, axis = plt.subplots(figsize=(max(8, len(rows) * 0.6), 4.5))
    axis.bar([x - 0.27 for x in xs], [r.naive_blocks for r in rows], 0.27, label="naive")
    axis.bar(list(xs), [r.block_blocks for r in rows], 0.27, label="block")
    axis.bar([x + 0.27 for x in xs], [r.vtoken_blocks for r in rows], 0.27, label="vtoken")
    axis.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    axis.set_ylabel("blocks retained per request")
    axis.legend()
    save_figure(figure, path)


def cli(
    engine: Annotated[Engine, typer.Option(help="Which engine runs the requests.")] = Engine.SIM,
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    quick: Annotated[bool, typer.Option(help="One prompt, 512 + 64 tokens.")] = False,
    policies: Annotated[str, typer.Option(help="Comma-separated policy names.")] = ",".join(
        POLICIES
    ),
    prompt_tokens: Annotated[int, typer.Option(min=64)] = 512,
    new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    prompts: Annotated[int, typer.Option(min=1, max=len(PROMPT_TOPICS))] = 3,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a PNG here.")] = None,
) -> None:
    """Retained KV blocks per request: without repack (naive), with repack (vtoken) on
    identical decisions, and under block-granular eviction (block)."""
    names = policy_names(policies)
    num_prompts = 1 if quick else prompts
    if engine is Engine.VLLM:
        rows = run_vllm(model, names, list(KEEP_RATIOS), num_prompts, prompt_tokens, new_tokens)
    else:
        rows = run_sim(
            model,
            names,
            list(KEEP_RATIOS),
            list(BLOCK_SIZES),
            num_prompts,
            prompt_tokens,
            new_tokens,
        )
    print_table(rows, f"Retained KV blocks per request ({engine.value}, {model})")
    if json_path is not None:
        document = {"engine": engine.value, "model": model, "results": [asdict(r) for r in rows]}
        write_json(json_path, document)
    if plot_path is not None:
        plot(rows, plot_path)
