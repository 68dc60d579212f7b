"""`vtoken bench concurrency`: how many requests one fixed KV pool serves at once.

A vLLM CPU engine with the vToken plugin and a fixed pool (``--num-blocks`` blocks of 32
tokens) serves ``N`` requests submitted together: natural-text prompts of exactly
``--prompt-tokens`` tokens, ``--new-tokens`` generated greedily. ``N`` counts as served
concurrently when all ``N`` run in the same step at some point and none is preempted. The
largest such ``N`` is found by doubling, then bisection, for each case: no eviction, and
H2O at keep 0.2 and 0.5 in ``naive`` and ``vtoken`` mode (same decisions; naive keeps
every block that still holds a live token) and in ``block`` mode (block-granular
eviction: whole lowest-scored blocks dropped, no repack). One engine per mode; each
request carries its policy in ``extra_args["vtoken_policy"]``. Tokens/s is measured on
the run at that ``N``.
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import PROMPT_TOPICS, csv_items, model_prompts, write_json


@dataclass(frozen=True, slots=True)
class Case:
    """A case to search: the policy every request carries, its keep ratio, and the mode
    of the engine that serves it."""

    policy: str
    keep: float
    mode: str


MODES = ("vtoken", "naive", "block")
CASES = (Case("none", 1.0, "vtoken"),) + tuple(
    Case("h2o", keep, mode) for keep in (0.2, 0.5) for mode in ("naive", "block", "vtoken")
)


@dataclass(frozen=True, slots=True)
class CaseResult:
    """A case's result (a row of the JSON's ``cases``)."""

    policy: str
    keep: float
    mode: str
    num_blocks: int
    max_concurrency: int
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Trial:
    served: bool  # all requests ran in one step and none was preempted
    peak_running: int
    preempted: bool
    tokens_per_s: float


class TrialRunner:
    """Runs trials of ``N`` simultaneous requests on one engine (mode fixed)."""

    def __init__(self, llm: Any, prompts: list[list[int]], new_tokens: int) -> None:
        from workers.engine import engine_scheduler, engine_state

        self.llm = llm
        self.engine = llm.llm_engine
        self.scheduler = engine_scheduler(llm)
        state = engine_state(llm)
        if state is None:
            raise RuntimeError("the engine runs without vToken")
        self.state = state
        self.prompts = prompts
        self.new_tokens = new_tokens
        self.num_submitted = 0

    def run(self, num_requests: int, policy: str, keep: float) -> Trial:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        spec = {"policy": policy, "keep_ratio": None if policy == "none" else keep}
        params = SamplingParams(
            max_tokens=self.new_tokens,
            temperature=0,
            ignore_eos=True,
            extra_args={"vtoken_policy": spec},
        )
        ids = []
        for index in range(num_requests):
            ids.append(f"c{self.num_submitted}")
            self.num_submitted += 1
            prompt = self.prompts[index % len(self.prompts)]
            self.engine.add_request(ids[-1], TokensPrompt(prompt_token_ids=prompt), params)
        preemptions_before = self.state.num_preemptions
        peak, finished_early, start = 0, False, time.perf_counter()
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            peak = max(peak, len(self.scheduler.running))
            preempted = self.state.num_preemptions > preemptions_before
            finished_early |= any(o.finished for o in outputs) and peak < num_requests
            if preempted or finished_early:  # the trial has failed: stop paying for it
                self.engine.abort_request(ids)
        elapsed = time.perf_counter() - start
        preempted = self.state.num_preemptions > preemptions_before
        served = peak == num_requests and not preempted
        rate = num_requests * self.new_tokens / elapsed if served else 0.0
        return Trial(served, peak, preempted, rate)


def max_concurrency(run: Any, limit: int) -> tuple[int, float]:
    """Largest ``n <= limit`` with ``run(n).served`` (doubling, then bisection), and its rate.

    Assumes served-ness is monotone in ``n`` (a bigger batch never needs less memory).
    """
    best, rate, n, failed = 0, 0.0, 1, limit + 1
    while n <= limit:
        trial = run(n)
        if not trial.served:
            failed = n
            break
        best, rate = n, trial.tokens_per_s
        n *= 2
    low, high = best, min(failed, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        trial = run(middle)
        if trial.served:
            low, rate = middle, trial.tokens_per_s
        else:
            high = middle
    return low, rate


def run_cases(
    model: str,
    num_blocks: int,
    prompt_tokens: int,
    new_tokens: int,
    limit: int,
    modes: tuple[str, ...] = MODES,
) -> list[CaseResult]:
    path, prompts = model_prompts(model, len(PROMPT_TOPICS), prompt_tokens)
    results = []
    for mode in modes:
        results += _run_mode(path, mode, prompts, num_blocks, new_tokens, limit)
        # Nothing may keep this engine alive: its shutdown tears down vLLM's process
        # groups, which must happen before the next engine starts.
        gc.collect()
    return results


def engine_settings(
    mode: str, prompts: list[list[int]], num_blocks: int, new_tokens: int, limit: int
) -> dict[str, Any]:
    """The engine of one mode (``make_llm``'s keyword arguments): vToken on with policy
    ``none`` (each request brings its own), ``num_blocks`` 32-token blocks."""
    return {
        "vtoken": {"policy": "none", "mode": mode},
        "num_blocks": num_blocks,
        "max_model_len": len(prompts[0]) + new_tokens + 32,
        "max_num_seqs": limit,
    }


def _run_mode(
    path: str, mode: str, prompts: list[list[int]], num_blocks: int, new_tokens: int, limit: int
) -> list[CaseResult]:
    from workers.engine import make_llm

    llm = make_llm(path, **engine_settings(mode, prompts, num_blocks, new_tokens, limit))
    runner = TrialRunner(llm, prompts, new_tokens)
    results = []
    for case in CASES:
        if case.mode == mode:
            trial = functools.partial(runner.run, policy=case.policy, keep=case.keep)
            best, rate = max_concurrency(trial, limit)
            results.append(
                CaseResult(case.policy, case.keep, mode, num_blocks, best, round(rate, 2))
            )
            typer.echo(
                f"{case.policy} keep={case.keep} {mode}: {best} concurrent, {rate:.1f} tok/s"
            )
    return results


def cli(
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    num_blocks: Annotated[int, typer.Option(min=4, help="KV pool size, 32-token blocks.")] = 64,
    prompt_tokens: Annotated[int, typer.Option(min=32)] = 256,
    new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    limit: Annotated[int, typer.Option(min=1, help="Largest N tried.")] = 64,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated: vtoken, naive, block.")] = ",".join(
        MODES
    ),
) -> None:
    """Largest number of concurrent requests a fixed KV pool serves without preemption."""
    chosen = tuple(csv_items(modes))
    if not chosen or set(chosen) - set(MODES):
        raise typer.BadParameter(f"modes must be among {', '.join(MODES)}, got {modes!r}")
    cases = run_cases(model, num_blocks, prompt_tokens, new_tokens, limit, chosen)
    by_key = {(c.policy, c.keep, c.mode): c for c in cases}
    for keep in (0.2, 0.5):
        for baseline in ("naive", "block"):
            if {"vtoken", baseline} <= set(chosen):
                vtoken, other = by_key[("h2o", keep, "vtoken")], by_key[("h2o", keep, baseline)]
                ratio = vtoken.max_concurrency / max(other.max_concurrency, 1)
                typer.echo(f"h2o keep={keep}: vtoken/{baseline} = {ratio:.2f}x")
    if json_path is not None:
        document = {
            "model": model,
            "block_size": 32,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "cases": [asdict(c) for c in cases],
        }
        write_json(json_path, document)
