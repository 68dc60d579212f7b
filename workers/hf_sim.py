"""A reference engine: Hugging Face transformers with vToken driving its KV cache.

The evicted tokens are really removed from the model's cache and the survivors are kept in
the order of the token table's slots (the order a paged engine stores them in after a
repack); positions stay logical. A policy that keeps a set per layer or per (layer, KV
head) (``vtoken/groups.py``) has each layer's (and head's) cache cut to its own set. So the
attention a policy sees, and therefore its decisions, are the ones a real engine running
vToken would produce. Used by ``vtoken bench fragmentation --engine sim`` and as the
oracle for the vLLM plugin's tests.

A hybrid model (Gemma 3: ``config.layer_types`` with sliding-window layers) is driven as
vToken drives it in vLLM: eviction and scores on the full-attention layers only; the
sliding-window layers keep their window (transformers' sliding cache layers, logical).
It keeps one set per request (as the vLLM plugin does for such models).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vtoken.groups import ModelGeometry
from vtoken.manager import VTokenManager
from vtoken.policy import EvictionPolicy, ScoreNeeds, StepAttention
from workers.config import ScoreLayers, VTokenConfig, score_layer_ids
from workers.statistics import reduce_attention

BudgetFn = Callable[[int], int]  # num_logical tokens -> live-token budget


@dataclass(slots=True)
class SimResult:
    """Greedy tokens and every step's evicted logical ids."""

    token_ids: list[int]
    evicted: list[np.ndarray] = field(default_factory=list)


class HFSimEngine:
    """Greedy generation of one request at a time under a vToken manager."""

    def __init__(
        self, model_path: str, score_layers: ScoreLayers | None = None, threads: int = 0
    ) -> None:
        """``score_layers``: as ``VTokenConfig.score_layers`` (``None``: its default)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        config = self.model.config
        num_layers = config.num_hidden_layers
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.geometry = ModelGeometry(num_layers, kv_heads)
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        full = [i for i, kind in enumerate(kinds) if kind != "sliding_attention"]
        self.hybrid = len(full) < num_layers
        default = VTokenConfig.model_fields["score_layers"].default
        chosen = score_layer_ids(default if score_layers is None else score_layers, len(full))
        self.score_layers = [full[i] for i in chosen]  # full-attention layers only

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        policy: EvictionPolicy | None,
        budget: BudgetFn,
        managers: Sequence[VTokenManager],
        request_id: str = "r0",
        chunk_size: int | None = None,
    ) -> SimResult:
        """Greedy decoding; the first manager's slot order drives the cache, every manager
        gets the same allocations and evictions (paired comparisons on identical decisions;
        a policy that keeps a set per layer or head has no paired managers, and a first
        manager without geometry gets the model's).
        A block-mode manager takes whole blocks only: it decides (the first manager), or
        follows one of its own block size that does.

        ``chunk_size``: the prompt is prefilled ``chunk_size`` tokens a step, as a paged
        engine's chunked prefill with that token budget (``None``: in one step). After a
        chunk that does not complete the prompt, a policy that evicts during prefill
        evicts to ``budget`` of the tokens computed so far (``evicted`` gets an entry for
        that step), any other only observes the chunk, as the vLLM plugin does in
        ``eager`` mode (``workers/scheduler_side.py``)."""
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        session = _Session(self, len(prompt_ids), policy, budget, managers, request_id)
        result = SimResult(token_ids=[])
        prompt = list(prompt_ids)
        size = chunk_size or len(prompt)
        for start in range(0, len(prompt) - size, size):  # every chunk but the last
            session.step(prompt[start : start + size], evict=session.evicts_during_prefill)
            if session.evicts_during_prefill:
                result.evicted.append(session.last_evicted)
        next_ids = prompt[(len(prompt) - 1) // size * size :]
        for _ in range(max_new_tokens):
            logits = session.step(next_ids)
            result.evicted.append(session.last_evicted)
            next_ids = [int(logits[-1].argmax())]
            result.token_ids.append(next_ids[0])
        return result

    @torch.inference_mode()
    def teacher_forced_nll(
        self,
        context_ids: Sequence[int],
        target_ids: Sequence[int],
        policy: EvictionPolicy | None,
        budget: BudgetFn,
        manager: VTokenManager,
    ) -> float:
        """Mean negative log-likelihood of ``target_ids`` fed one token per step after
        ``context_ids``, evicting to the budget after every step (a perplexity probe)."""
        session = _Session(self, len(context_ids), policy, budget, [manager], "nll")
        logits = session.step(list(context_ids))
        total = 0.0
        for index, token in enumerate(target_ids):
            total -= float(torch.log_softmax(logits[-1].float(), dim=-1)[token])
            if index + 1 < len(target_ids):
                logits = session.step([token])
        return total / len(target_ids)


class _Session:
    """One request's model cache, kept equal to the primary manager's live tokens."""

    def __init__(
        self,
        engine: HFSimEngine,
        prompt_len: int,
        policy: EvictionPolicy | None,
        budget: BudgetFn,
        managers: Sequence[VTokenManager],
        request_id: str,
    ) -> None:
        from transformers import DynamicCache

        self.engine, self.policy, self.budget = engine, policy, budget
        self.primary, *self.shadows = managers
        self.request_id = request_id
        if policy is not None and policy.granularity != "request":
            if self.shadows:
                raise ValueError("paired managers follow one kept set per request")
            if engine.hybrid:
                raise ValueError("a model with sliding-window layers keeps one set per request")
            if len(engine.score_layers) != engine.geometry.num_layers:
                raise ValueError("a set per layer or head needs every layer scored")
            if self.primary.geometry is None:
                self.primary.geometry = engine.geometry
        self.primary.add_request(request_id, prompt_len, policy=policy)
        for shadow in self.shadows:
            shadow.add_request(request_id, prompt_len)
        self.needs = policy.score_needs() if policy is not None else ScoreNeeds()
        self.evicts_during_prefill = policy is not None and policy.evicts_during_prefill
        # With the config, a hybrid model's sliding layers get window caches (transformers').
        self.cache = DynamicCache(config=engine.model.config if engine.hybrid else None)
        self.cache_ids = np.zeros((1, 0), dtype=np.int64)  # [groups, n]: the cache's order
        self.last_evicted = np.zeros(0, dtype=np.int64)

    def step(self, input_ids: list[int], evict: bool = True) -> torch.Tensor:
        """Forward ``input_ids``, then evict and reclaim (``evict``), or only let the policy
        observe the step (a prefill chunk); returns ``[len(input_ids), vocab]`` logits."""
        table = self.primary.requests[self.request_id].table
        start = table.num_logical
        if self.engine.hybrid and len(input_ids) > 1 and table.num_live < start:
            # transformers masks a hybrid model's full layers causally from the logical
            # position: exact for one new token, not for a chunk after an eviction.
            raise ValueError("a hybrid model's reference evicts between single-token steps")
        for manager in (self.primary, *self.shadows):
            if manager.allocate(self.request_id, len(input_ids)) is None:
                raise RuntimeError("the block pool is too small for this run")
        output = self.engine.model(
            input_ids=torch.tensor([input_ids]),
            position_ids=torch.arange(start, start + len(input_ids)).unsqueeze(0),
            past_key_values=self.cache,
            use_cache=True,
            output_attentions=self.needs.any,
        )
        new_ids = np.arange(start, start + len(input_ids))
        self.cache_ids = np.hstack([self.cache_ids, np.tile(new_ids, (len(self.cache_ids), 1))])
        attention = self._attention(output.attentions or ())
        if not evict:
            self.primary.observe(self.request_id, attention)
            self.last_evicted = np.zeros(0, dtype=np.int64)
            return output.logits[0]
        evicted = self.primary.evict(self.request_id, self.budget(table.num_logical), attention)
        self.primary.reclaim([self.request_id])
        for shadow in self.shadows:
            shadow.evict_ids(self.request_id, evicted)
            shadow.reclaim([self.request_id])
        target = table.group_logical_ids()
        self.cache_ids = _reorder(self.cache, self.cache_ids, target, self.engine.geometry)
        self.last_evicted = evicted
        return output.logits[0]

    def _attention(self, attentions: tuple[torch.Tensor, ...]) -> StepAttention:
        """The statistics the policy asks for, from the ``[1, heads, q_len, n_live]``
        weights of each layer (cache order == the primary table's slot order)."""
        if not self.needs.any:
            return StepAttention()
        layers = self.engine.score_layers
        kv_heads = self.engine.geometry.num_kv_heads
        return reduce_attention((attentions[i][0] for i in layers), self.needs, kv_heads)


def _reorder(
    cache: object, cache_ids: np.ndarray, target_ids: np.ndarray, geometry: ModelGeometry
) -> np.ndarray:
    """Make the model cache hold exactly ``target_ids`` (``[groups, n]``: one row, or one
    per layer or per (layer, KV head)), in that order; ``cache_ids`` is what it holds."""
    if cache_ids.shape == target_ids.shape and np.array_equal(cache_ids, target_ids):
        return cache_ids
    if len(cache_ids) != len(target_ids):  # the first step of a grouped table
        cache_ids = np.broadcast_to(cache_ids, (len(target_ids), cache_ids.shape[1]))
    rows = np.arange(len(cache_ids))[:, None]
    position = np.empty((len(cache_ids), int(cache_ids.max()) + 1), dtype=np.int64)
    position[rows, cache_ids] = np.arange(cache_ids.shape[1])
    index = position[rows, target_ids]
    layers = cache.layers  # type: ignore[attr-defined]
    if len(index) == 1:
        flat = torch.from_numpy(index[0])
        for layer in layers:
            if getattr(layer, "is_sliding", False):
                continue  # a sliding-window layer keeps its window (hybrid models)
            layer.keys = layer.keys.index_select(2, flat)
            layer.values = layer.values.index_select(2, flat)
        return target_ids.copy()
    per_layer = index.reshape(geometry.num_layers, -1, index.shape[1])  # [L, 1 or Hkv, n]
    for layer, rows_of_layer in zip(layers, per_layer, strict=True):
        shape = layer.keys.shape  # [1, Hkv, n_cache, head_dim]
        gather = torch.from_numpy(np.ascontiguousarray(rows_of_layer))[None, :, :, None]
        gather = gather.expand(1, shape[1], index.shape[1], shape[3])
        layer.keys = layer.keys.gather(2, gather)
        layer.values = layer.values.gather(2, gather)
    return target_ids.copy()
