"""Gate (a): an exact replica reproduces ``bench preemption`` and ``bench concurrency``.

Both benches run real vLLM CPU engines; what they count is decided by the scheduler alone
once the policies' decisions are fixed: greedy requests with ``ignore_eos`` and a fixed
``max_tokens`` generate the same number of tokens whatever the tokens are, and without a
prefix cache the token values never reach a scheduling decision. So:

- for policies that read no attention (Random, StreamingLLM) and for vanilla vLLM, the
  simulated counts must equal the real ones exactly, with no recording;
- for policies that read attention (H2O, TOVA, ...), they are equal when the real run's
  statistics are replayed (``ReplayedAttention``); with synthetic statistics they are an
  estimate (the model's attention is not the synthetic one).

The real side calls the benches' own code (``bench.preemption.run_engine``,
``bench.concurrency.TrialRunner`` and ``max_concurrency``; the preemption engine runs
without a tokenizer, the concurrency engine detokenizes, so it needs one); the simulated
side mirrors them on an ``ExactReplica`` with the same engine settings.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass
from typing import Any

from bench.concurrency import TrialRunner, engine_settings, max_concurrency
from bench.preemption import BLOCK_SIZE, engine_vtoken, record_live_at_end, run_engine
from sim.attention import AttentionSource, ReplayedAttention, SyntheticAttention, recording_scores
from sim.replica import ExactReplica, ReplicaConfig
from vtoken.policy import StepAttention

PREEMPTION_COUNTS = (
    "preemptions",
    "recomputed_tokens",
    "evictions_under_pressure",
    "evictions_below_budget",
    "scored_request_steps",
    "completed",
    "mean_live_tokens_at_end",
)


@dataclass(frozen=True, slots=True)
class Comparison:
    """One gate row: the real and simulated counts of one case, and whether they match."""

    bench: str
    case: str
    attention: str  # "none needed", "replayed" or "synthetic"
    real: dict[str, Any]
    simulated: dict[str, Any]

    @property
    def equal(self) -> bool:
        return self.real == self.simulated


# ---------------------------------------------------------------- bench preemption


def simulate_preemption(
    model_dir: str,
    engine: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    keep: float,
    policy: str,
    attention: AttentionSource | None = None,
) -> dict[str, Any]:
    """``bench.preemption.run_engine``'s counts from an exact replica."""
    replica = ExactReplica(
        ReplicaConfig(
            model_dir,
            engine_vtoken(engine, policy, keep),
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=len(prompts[0]) + new_tokens + BLOCK_SIZE,
            max_num_seqs=len(prompts),
        ),
        attention,
    )
    state = replica.state
    live_at_end = record_live_at_end(state)
    for index, prompt in enumerate(prompts):
        replica.add_request(str(index), prompt, new_tokens)
    completed = 0
    while (record := replica.step()) is not None:
        completed += len(record.finished)
    return {
        "preemptions": replica.num_preemptions,
        "recomputed_tokens": replica.recomputed_tokens,
        "evictions_under_pressure": state.num_evictions_under_pressure if state else 0,
        "evictions_below_budget": state.num_evictions_below_budget if state else 0,
        "scored_request_steps": state.counters.num_scored_request_steps if state else 0,
        "completed": completed,
        "mean_live_tokens_at_end": round(sum(live_at_end) / len(live_at_end), 1)
        if live_at_end
        else None,
    }


def real_preemption(
    model_dir: str,
    engine: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    keep: float,
    policy: str,
) -> tuple[dict[str, Any], list[dict[str, StepAttention]]]:
    """``bench.preemption.run_engine`` on a real CPU engine: its counts and the attention
    statistics its scheduler received at each step."""
    with recording_scores() as engines:
        row = run_engine(
            model_dir, engine, prompts, num_blocks, new_tokens, keep, policy,
            skip_tokenizer_init=True,
        )  # fmt: skip
    counts = {name: getattr(row, name) for name in PREEMPTION_COUNTS}
    return counts, engines[0] if engines else []


def compare_preemption(
    model_dir: str,
    engine: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    keep: float,
    policy: str,
    synthetic: bool = False,
) -> Comparison:
    """Real vs simulated counts of one engine of ``bench preemption``; the simulation
    replays the real statistics unless ``synthetic``."""
    real, recorded = real_preemption(
        model_dir, engine, prompts, num_blocks, new_tokens, keep, policy
    )
    attention, source = _source(recorded, synthetic)
    simulated = simulate_preemption(
        model_dir, engine, prompts, num_blocks, new_tokens, keep, policy, attention
    )
    return Comparison("preemption", f"{engine} {policy} keep={keep}", source, real, simulated)


# ---------------------------------------------------------------- bench concurrency


class SimTrialRunner:
    """``bench.concurrency.TrialRunner`` on an exact replica: ``N`` requests submitted
    together; served when all ran in one step and none was preempted."""

    def __init__(self, replica: ExactReplica, prompts: list[list[int]], new_tokens: int) -> None:
        self.replica = replica
        self.prompts = prompts
        self.new_tokens = new_tokens
        self.num_submitted = 0

    def run(self, num_requests: int, policy: str, keep: float) -> Any:
        from bench.concurrency import Trial

        spec = {"policy": policy, "keep_ratio": None if policy == "none" else keep}
        replica = self.replica
        ids = []
        for index in range(num_requests):
            ids.append(f"c{self.num_submitted}")
            self.num_submitted += 1
            prompt = self.prompts[index % len(self.prompts)]
            replica.add_request(ids[-1], prompt, self.new_tokens, {"vtoken_policy": spec})
        preemptions_before = replica.num_preemptions
        peak, finished_early = 0, False
        while replica.has_unfinished_requests():
            record = replica.step()
            peak = max(peak, replica.num_running)
            preempted = replica.num_preemptions > preemptions_before
            finished_early |= bool(record and record.finished) and peak < num_requests
            if preempted or finished_early:
                replica.abort(ids)
        preempted = replica.num_preemptions > preemptions_before
        return Trial(peak == num_requests and not preempted, peak, preempted, 0.0)


def simulate_concurrency(
    model_dir: str,
    mode: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    limit: int,
    policy: str,
    keep: float,
    attention: AttentionSource | None = None,
) -> dict[str, Any]:
    settings = engine_settings(mode, prompts, num_blocks, new_tokens, limit)
    replica = ExactReplica(ReplicaConfig(model_dir, **settings), attention)
    runner = SimTrialRunner(replica, prompts, new_tokens)
    best, _ = max_concurrency(functools.partial(runner.run, policy=policy, keep=keep), limit)
    return {"max_concurrency": best, "preemptions": replica.num_preemptions}


def real_concurrency(
    model_dir: str,
    mode: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    limit: int,
    policy: str,
    keep: float,
) -> tuple[dict[str, Any], list[dict[str, StepAttention]]]:
    """``bench concurrency``'s search for one case on a real CPU engine (its own
    ``TrialRunner`` and ``max_concurrency``), and the statistics it received."""
    from workers.engine import engine_state, make_llm

    settings = engine_settings(mode, prompts, num_blocks, new_tokens, limit)
    with recording_scores() as engines:
        llm = make_llm(model_dir, **settings)
        runner = TrialRunner(llm, prompts, new_tokens)
        best, _ = max_concurrency(functools.partial(runner.run, policy=policy, keep=keep), limit)
    state = engine_state(llm)
    counts = {"max_concurrency": best, "preemptions": state.num_preemptions if state else 0}
    del llm, runner, state
    gc.collect()  # the engine's shutdown must finish before the next one starts
    return counts, engines[0] if engines else []


def compare_concurrency(
    model_dir: str,
    mode: str,
    prompts: list[list[int]],
    num_blocks: int,
    new_tokens: int,
    limit: int,
    policy: str,
    keep: float,
    synthetic: bool = False,
) -> Comparison:
    real, recorded = real_concurrency(
        model_dir, mode, prompts, num_blocks, new_tokens, limit, policy, keep
    )
    attention, source = _source(recorded, synthetic)
    simulated = simulate_concurrency(
        model_dir, mode, prompts, num_blocks, new_tokens, limit, policy, keep, attention
    )
    return Comparison("concurrency", f"{mode} {policy} keep={keep}", source, real, simulated)


def _source(
    recorded: list[dict[str, StepAttention]], synthetic: bool
) -> tuple[AttentionSource, str]:
    if not any(recorded):
        return SyntheticAttention(), "none needed"
    if synthetic:
        return SyntheticAttention(), "synthetic"
    return ReplayedAttention(recorded), "replayed"
