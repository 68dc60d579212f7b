"""A reference engine: Hugging Face transformers with vToken driving its KV cache.

The evicted tokens are really removed from the model's cache and the survivors are kept in
the order of the token table's slots (the order a paged engine stores them in after a
repack); positions stay logical. So the attention a policy sees, and therefore its
decisions, are the ones a real engine running vToken would produce. Used by
``vtoken bench fragmentation --engine sim`` and as the oracle for the vLLM plugin's tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vtoken.manager import VTokenManager
from vtoken.policy import EvictionPolicy, ScoreNeeds, StepAttention

BudgetFn = Callable[[int], int]  # num_logical tokens -> live-token budget


@dataclass(slots=True)
class SimResult:
    """Greedy tokens and every step's evicted logical ids."""

    token_ids: list[int]
    evicted: list[np.ndarray] = field(default_factory=list)


def step_attention(
    attentions: Sequence[torch.Tensor], needs: ScoreNeeds, score_layers: Sequence[int] | None
) -> StepAttention:
    """Reduce per-layer ``[1, heads, q_len, n_live]`` weights to the statistics ``needs`` asks."""
    if not needs.any:
        return StepAttention()
    layers = range(len(attentions)) if score_layers is None else score_layers
    stacked = torch.stack([attentions[i][0] for i in layers]).float()  # [L, H, q, k]
    rows = stacked.mean(dim=(0, 1))  # [q, k]; each row sums to 1
    window = max(needs.query_window, 1)
    return StepAttention(
        step_scores=rows.sum(0).numpy() if needs.step_scores else None,
        window_rows=rows[-window:].numpy() if needs.query_window else None,
        head_scores=stacked[:, :, -window:].sum(2).numpy() if needs.per_head else None,
    )


class HFSimEngine:
    """Greedy generation of one request at a time under a vToken manager."""

    def __init__(
        self, model_path: str, score_layers: Sequence[int] | None = None, threads: int = 0
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        self.score_layers = score_layers

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        policy: EvictionPolicy | None,
        budget: BudgetFn,
        managers: Sequence[VTokenManager],
        request_id: str = "r0",
    ) -> SimResult:
        """Run greedy decoding; the first manager's slot order drives the cache, every manager
        gets the same allocations and evictions (paired comparisons on identical decisions)."""
        from transformers import DynamicCache

        primary, *shadows = managers
        primary.add_request(request_id, len(prompt_ids), policy=policy)
        for shadow in shadows:
            shadow.add_request(request_id, len(prompt_ids))
        needs = policy.score_needs() if policy is not None else ScoreNeeds()
        cache = DynamicCache()
        cache_ids = np.zeros(0, dtype=np.int64)  # logical ids in the model cache's order
        result = SimResult(token_ids=[])
        next_ids = list(prompt_ids)
        for _ in range(max_new_tokens):
            start = primary.requests[request_id].table.num_logical
            for manager in managers:
                if manager.allocate(request_id, len(next_ids)) is None:
                    raise RuntimeError("the block pool is too small for this run")
            output = self.model(
                input_ids=torch.tensor([next_ids]),
                position_ids=torch.arange(start, start + len(next_ids)).unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
                output_attentions=needs.any,
            )
            cache_ids = np.concatenate([cache_ids, np.arange(start, start + len(next_ids))])
            attention = step_attention(output.attentions or (), needs, self.score_layers)
            table = primary.requests[request_id].table
            evicted = primary.evict(request_id, budget(table.num_logical), attention)
            primary.reclaim([request_id])
            for shadow in shadows:
                shadow.evict_ids(request_id, evicted)
                shadow.reclaim([request_id])
            cache_ids = _reorder(cache, cache_ids, table.live_logical_ids())
            result.evicted.append(evicted)
            next_token = int(output.logits[0, -1].argmax())
            result.token_ids.append(next_token)
            next_ids = [next_token]
        return result


def _reorder(cache: object, cache_ids: np.ndarray, target_ids: np.ndarray) -> np.ndarray:
    """Make the model cache hold exactly ``target_ids``, in that order."""
    if np.array_equal(cache_ids, target_ids):
        return cache_ids
    position = np.empty(int(cache_ids.max()) + 1, dtype=np.int64)
    position[cache_ids] = np.arange(cache_ids.size)
    index = torch.from_numpy(position[target_ids])
    for layer in cache.layers:  # type: ignore[attr-defined]
        layer.keys = layer.keys.index_select(2, index)
        layer.values = layer.values.index_select(2, index)
    return target_ids.copy()
