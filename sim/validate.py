"""The validation gates that exist (``vtoken sim validate``).

Gate (a), ``exact_counts``: real CPU engines against exact replicas on ``bench
preemption``'s workload (every engine; StreamingLLM and Random need no statistics, H2O
replays the real run's) and ``bench concurrency``'s search (vToken with Random; H2O,
replayed, in the vtoken, naive and block modes). Passed when every count is equal.
Gate (b) (a fitted CPU profile predicting held-out ``bench serve`` runs) is not built;
gate (c), ``gpu_tables`` (the GPU step-time model against published serving throughput),
is ``sim/gpu_gate.py``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bench.common import PROMPT_TOPICS, model_prompts
from sim.exact_gate import Comparison, compare_concurrency, compare_preemption

CONCURRENCY_CASES = (("vtoken", "random"), ("naive", "h2o"), ("block", "h2o"), ("vtoken", "h2o"))
PREEMPTION_CASES = (
    ("vanilla", "streaming_llm"),
    ("eager", "streaming_llm"),
    ("on_demand", "random"),
    ("on_demand_at_budget", "streaming_llm"),
    ("eager", "h2o"),
    ("on_demand", "h2o"),
)


def exact_counts_gate(
    model: str, requests: int, prompt_tokens: int, new_tokens: int, num_blocks: int
) -> dict[str, Any]:
    path, topics = model_prompts(model, len(PROMPT_TOPICS), prompt_tokens)
    prompts = [topics[i % len(topics)] for i in range(requests)]
    rows: list[Comparison] = [
        compare_preemption(path, engine, prompts, num_blocks, new_tokens, 0.5, policy)
        for engine, policy in PREEMPTION_CASES
    ]
    rows += [
        compare_concurrency(path, mode, prompts, num_blocks, new_tokens, 4 * requests, policy,
                            0.5)
        for mode, policy in CONCURRENCY_CASES
    ]  # fmt: skip
    return {
        "passed": all(row.equal for row in rows),
        "rows": [asdict(row) | {"equal": row.equal} for row in rows],
        "settings": {
            "model": model,
            "requests": requests,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "num_blocks": num_blocks,
            "keep": 0.5,
        },
    }
