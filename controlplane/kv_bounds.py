"""A request's KV in blocks under its policy: what admission reserves for it
(:func:`kv_bounds`; the numbers a policy protects come from one source,
``vtoken.policy.EvictionPolicy.protection``, through ``VTokenConfig.admission_protection``),
every KV cache group counted: a hybrid model's sliding-window groups hold up to their
window beside the full-attention group (:class:`SlidingWindows`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlidingWindows:
    """A hybrid model's sliding-window KV cache groups, as plain numbers (the engine's
    ``GroupLayout.windows``; ``workers.model_windows.sliding_windows`` reads them from the
    model's config without starting an engine).

    ``windows``: one window in tokens per sliding group (empty: no sliding group).
    ``in_flight_tokens``: the most tokens the engines schedule and have not yet settled
    (vLLM's ``max_in_flight_tokens``: ``max_num_batched_tokens`` with synchronous
    scheduling; ``None``: unknown, so no window cap is counted). ``max_model_len``: the
    engines' context (``None``: unknown).

    A sequence of ``T`` tokens holds in each group at most ``min(ceil(T / block_size),
    cap)`` blocks, ``cap = ceil(min(window - 1 + in_flight_tokens, max_model_len) /
    block_size) + 1``: vLLM 0.32's own bound (``SlidingWindowSpec.
    max_admission_blocks_per_request``, applied by ``SlidingWindowManager.
    get_num_blocks_to_allocate`` at admission), which the engines' scheduler checks too."""

    windows: tuple[int, ...] = ()
    in_flight_tokens: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if any(window < 1 for window in self.windows):
            raise ValueError(f"sliding windows must be >= 1 token (got {self.windows})")
        if self.in_flight_tokens is not None and self.in_flight_tokens < 1:
            raise ValueError(f"need in_flight_tokens >= 1 (got {self.in_flight_tokens})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"need max_model_len >= 1 (got {self.max_model_len})")

    def blocks(self, num_tokens: int, block_size: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds in the sliding
        groups together (0 without any)."""
        held = math.ceil(num_tokens / block_size)
        total = 0
        for window in self.windows:
            cap = None
            if self.in_flight_tokens is not None:
                tokens = window - 1 + self.in_flight_tokens
                if self.max_model_len is not None:
                    tokens = min(tokens, self.max_model_len)
                cap = math.ceil(tokens / block_size) + 1
            total += held if cap is None else min(held, cap)
        return total


NO_WINDOWS = SlidingWindows()


@dataclass(frozen=True, slots=True)
class KVBounds:
    """A request's KV under its policy, in blocks.

    ``prefill_peak``: the most it holds until prefill ends: the whole prompt, or, when the
    engines evict during chunked prefill, one chunk plus its budget if fewer. ``steady``:
    the most it holds afterwards: prompt + max_tokens, or with a per-request eviction budget that
    budget plus one block (the step's new tokens before the policy evicts), whichever is
    smaller. ``peak`` is what admission reserves first. Both count every KV cache group:
    ``window`` is the sliding-window groups' part of ``steady`` (0 on a model without
    any), which the engine's own hold bound (full-attention group only) leaves out."""

    prefill_peak: int
    steady: int
    window: int = 0

    @property
    def peak(self) -> int:
        return max(self.prefill_peak, self.steady)


def kv_bounds(
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    eviction_budget_tokens: int | None,
    keep_ratio: float | None = None,
    n: int = 1,
    floor_tokens: int | None = None,
    protected_tokens: int = 0,
    protected_fraction: float = 0.0,
    prefill_chunk_tokens: int | None = None,
    sliding: SlidingWindows = NO_WINDOWS,
) -> KVBounds:
    """The request's :class:`KVBounds`; ``ValueError`` on negative sizes, an empty request
    or ``n < 1``.

    The steady bound is the smallest of prompt + max_tokens, the tenant's per-request cap
    (``eviction_budget_tokens``) and, without a cap, the engines' own ``keep_ratio`` of the
    longest sequence; a budget counts one block more (the step's new tokens). ``n``
    choices are ``n`` sequences: vLLM runs each as its own request holding its own KV,
    so both bounds are ``n`` times one sequence's, and at its worst case: the choices share
    the prompt's blocks through the prefix cache; each evicts on its own, copying what it
    keeps of a shared block into its own (copy on evict), but one that finds no free block
    for the copy keeps the shared prompt past its budget that step (the prompt is charged
    once, so this over-counts it). A budget ``B`` counts at least what the policy
    protects whatever its budget, ``protected_tokens + ceil(protected_fraction * B)``
    (sinks, a pinned prefix, recent windows: the engine keeps them past the budget).
    ``floor_tokens`` (a tenant that squeezes to floors) lowers the steady bound to that
    floor plus one block. Plain numbers (the control plane imports nothing of the engine's):
    their one source is the policy's ``protection()`` (``vtoken.policy.Protection``), which
    ``workers.config.VTokenConfig.admission_*`` turn into these.

    ``prefill_chunk_tokens`` (the engines' ``max_num_batched_tokens``, given only when
    their policies evict during prefill; ``None``: no chunking known) lowers the prefill
    peak of a single sequence with a budget to ``min(prompt blocks, chunk blocks + kept
    blocks)``: after each chunk the engine evicts to its budget at the tokens computed so
    far (at most the cap, or ``ceil(keep_ratio * prompt_tokens)``), keeping what the policy
    protects past it, then the next chunk opens at most ``ceil(chunk / block_size)`` blocks.
    The engine holds it there through ``hold_to_blocks`` (its steady bound) when the
    request counts below its worst case; otherwise its peak is at least the prompt.

    ``sliding``: a hybrid model's sliding-window groups, never evicted from (vLLM keeps
    their windows): each sequence also counts :meth:`SlidingWindows.blocks` of its prompt
    in the prefill peak and of prompt + max_tokens in the steady bound, whatever its
    budget (``n`` choices: each its own)."""
    if prompt_tokens < 0 or max_tokens < 0 or prompt_tokens + max_tokens == 0:
        raise ValueError(
            f"need prompt_tokens >= 0, max_tokens >= 0, not both 0 "
            f"(got {prompt_tokens}, {max_tokens})"
        )
    if n < 1:
        raise ValueError(f"need n >= 1 sequences (got {n})")
    if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
        raise ValueError(f"need prefill_chunk_tokens >= 1 (got {prefill_chunk_tokens})")
    longest = prompt_tokens + max_tokens
    window_prefill = sliding.blocks(prompt_tokens, block_size)
    window = sliding.blocks(longest, block_size)
    if n > 1:  # the choices share the prompt's blocks: a copy may wait for a free block
        worst = math.ceil(longest / block_size) + window
        prefill = math.ceil(prompt_tokens / block_size) + window_prefill
        return KVBounds(prefill_peak=n * prefill, steady=n * worst, window=n * window)
    steady = math.ceil(longest / block_size)
    prefill_peak = math.ceil(prompt_tokens / block_size)

    def kept_blocks(budget: int) -> int:  # what the policy keeps at ``budget``, in blocks
        kept = max(budget, protected_tokens + math.ceil(protected_fraction * budget))
        return math.ceil(kept / block_size)

    budget = eviction_budget_tokens
    if budget is None and keep_ratio is not None:
        budget = math.ceil(keep_ratio * longest)
    if budget is not None:
        steady = min(steady, kept_blocks(budget) + 1)
    if floor_tokens is not None:
        steady = min(steady, math.ceil(floor_tokens / block_size) + 1)
    prefill_budget = eviction_budget_tokens
    if prefill_budget is None and keep_ratio is not None:
        prefill_budget = math.ceil(keep_ratio * prompt_tokens)
    if prefill_chunk_tokens is not None and prefill_budget is not None:
        chunk_blocks = math.ceil(prefill_chunk_tokens / block_size)
        prefill_peak = min(prefill_peak, chunk_blocks + kept_blocks(prefill_budget))
    return KVBounds(
        prefill_peak=prefill_peak + window_prefill, steady=steady + window, window=window
    )
