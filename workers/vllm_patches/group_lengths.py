"""Physical lengths for the full-attention group only, in a hybrid engine (worker side).

vLLM 0.32's V1 runner fills one ``seq_lens`` for every KV cache group
(``_build_attention_metadata`` copies one ``CommonAttentionMetadata`` per group, changing
only the block table and slot mapping). A single-group engine makes that one physical
(``runner_hooks.prepare_inputs``). A hybrid engine cannot: its sliding-window layers
keep every token of their window and must see logical lengths and slots, its
full-attention layers see what vToken kept. So there ``prepare_inputs`` leaves the
runner's lengths logical, recomputes the full group's slot mapping from physical
positions, and leaves this step's evicted counts in a ``FullGroupLengths`` that the full
group's metadata builders (CPU attention: ``CPUAttentionMetadataBuilder.build``, wrapped
by ``build``) subtract from the ``seq_lens`` they are given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from workers.query_capture import to_device

LENGTHS_ATTRIBUTE = "vtoken_lengths"  # a full-group builder's (and the runner's) holder


@dataclasses.dataclass(slots=True)
class FullGroupLengths:
    """This step's evicted-token count per batch row (``[num_reqs]`` int32, host), or
    ``None`` when no scheduled request has evicted anything."""

    group: int
    offsets: torch.Tensor | None = None


def attach(runner: Any, group: int) -> FullGroupLengths:
    """Give the runner and every metadata builder of KV cache group ``group`` one holder."""
    lengths = FullGroupLengths(group)
    setattr(runner, LENGTHS_ATTRIBUTE, lengths)
    for attn_group in runner.attn_groups[group]:
        for builder in attn_group.metadata_builders:
            setattr(builder, LENGTHS_ATTRIBUTE, lengths)
    return lengths


def make_full_group_physical(
    runner: Any,
    lengths: FullGroupLengths,
    offsets: np.ndarray,
    num_scheduled_tokens: np.ndarray,
    total: int,
) -> None:
    """The full group's slot mapping from physical positions (logical minus each row's
    evicted count) and the counts its builders subtract; the other groups' stay vLLM's."""
    num_reqs = offsets.size
    per_token = np.repeat(offsets, num_scheduled_tokens).astype(np.int64)
    physical = runner.positions[:total] - to_device(per_token, runner.positions.device)
    runner.input_batch.block_table[lengths.group].compute_slot_mapping(
        num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], physical
    )
    lengths.offsets = torch.from_numpy(offsets.astype(np.int32))


def physical_metadata(common: Any, offsets: torch.Tensor) -> Any:
    """A copy of ``CommonAttentionMetadata`` with ``seq_lens`` (and its host upper bound,
    ``max_seq_len``) less ``offsets`` on the first ``len(offsets)`` rows."""
    num_rows = offsets.numel()
    seq_lens = common.seq_lens.clone()
    seq_lens[:num_rows] -= offsets.to(seq_lens.device)
    upper = common.seq_lens_cpu_upper_bound
    if upper is not None:
        upper = upper.clone()
        upper[:num_rows] -= offsets
    longest = upper if upper is not None else seq_lens
    return dataclasses.replace(
        common,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=upper,
        max_seq_len=int(longest.max()) if longest.numel() else 0,
    )


def build(original: Callable[..., Any]) -> Callable[..., Any]:
    """``build(common_prefix_len, common_attn_metadata, ...)`` of a metadata builder: a
    full-attention builder of a hybrid vToken engine builds from physical lengths."""

    def build(self: Any, common_prefix_len: int, common_attn_metadata: Any, *a: Any, **k: Any):
        lengths: FullGroupLengths | None = getattr(self, LENGTHS_ATTRIBUTE, None)
        if lengths is not None and lengths.offsets is not None:
            common_attn_metadata = physical_metadata(common_attn_metadata, lengths.offsets)
        return original(self, common_prefix_len, common_attn_metadata, *a, **k)

    return build
