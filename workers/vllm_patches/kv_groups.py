"""An engine's KV cache groups, as vLLM 0.32 forms them, and which of them vToken manages.

vLLM puts layers whose KV caches need the same number of slots in one group with one
block table (``KVCacheConfig.kv_cache_groups``); a model mixing sliding-window and full
attention layers (Gemma 3: five local layers to one global; gpt-oss: alternating) gets
one group per kind and layer count, all drawing blocks from one pool. vToken runs its
token tables, eviction and repack on the one full-attention group and leaves the
sliding-window groups to vLLM's own sliding-window manager, which frees their blocks as
the window moves. Everything else is refused at start, with the model's layer types
named (``kv_group_problems``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Which KV cache group vToken manages (``full_group``: its token tables, eviction,
    scores and repack) and which vLLM's sliding-window manager keeps
    (``sliding_groups``, their windows in tokens in ``windows``)."""

    full_group: int
    sliding_groups: tuple[int, ...] = ()
    windows: tuple[int, ...] = ()
    full_layer_names: tuple[str, ...] = ()

    @property
    def num_groups(self) -> int:
        return 1 + len(self.sliding_groups)

    @property
    def hybrid(self) -> bool:
        return bool(self.sliding_groups)


def layer_index(name: str) -> int | None:
    """The decoder layer index in a vLLM layer name (``model.layers.5.self_attn.attn``)."""
    match = _LAYER_INDEX.search(name)
    return None if match is None else int(match.group(1))


def _ranges(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 4, 6, 7]`` -> ``"0-2, 4, 6-7"``."""
    spans: list[list[int]] = []
    for index in sorted(indices):
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _kind(spec: Any) -> str:
    """A group's layer type in words (vLLM's ``get_kv_cache_spec_kind``, with the window
    of a sliding or chunked one and the sizes of per-layer specs that differ)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, get_kv_cache_spec_kind

    kind = get_kv_cache_spec_kind(spec).value.replace("_", " ")
    if isinstance(spec, UniformTypeKVCacheSpecs):
        sizes = sorted({s.page_size_bytes for s in spec.kv_cache_specs.values()})
        return f"{kind} with per-layer KV sizes {sizes} bytes per block"
    window = getattr(spec, "sliding_window", None)
    chunk = getattr(spec, "attention_chunk_size", None)
    if "full" not in kind:
        return f"{kind} {window or chunk}" if window or chunk else kind
    if window:  # vLLM's hybrid KV cache manager is off: sliding layers allocated as full
        return f"sliding window {window} allocated as full attention"
    return f"chunked local attention {chunk} allocated as full attention" if chunk else kind


def describe_groups(kv_cache_config: Any) -> str:
    """Every group's layer type and layers, e.g. ``"group 0: sliding window 512 (layers
    0-4), group 1: full attention (layers 5)"``."""
    parts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        layers = [layer_index(name) for name in group.layer_names]
        known = [i for i in layers if i is not None]
        where = f"layers {_ranges(known)}" if len(known) == len(layers) else group.layer_names
        parts.append(f"group {index}: {_kind(group.kv_cache_spec)} ({where})")
    return ", ".join(parts)


def _is_full(spec: Any) -> bool:
    """Plain full attention: not a sliding window or chunked local attention that vLLM
    promoted to a full-attention spec (its hybrid manager off), not a padded page."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return (
        type(spec) is FullAttentionSpec
        and spec.sliding_window is None
        and getattr(spec, "attention_chunk_size", None) is None
        and getattr(spec, "page_size_padded", None) is None
    )


def _geometry(spec: Any) -> tuple[Any, ...]:
    """What one block of a layer looks like in memory: every group vToken runs beside must
    match the full group's (one repack, one layout for every layer's cache)."""
    return tuple(
        getattr(spec, name, None)
        for name in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_padded")
    )


def _is_sliding(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return type(spec) is SlidingWindowSpec


def kv_group_problems(kv_cache_config: Any) -> list[str]:
    """Why vToken cannot manage these KV cache groups (empty: it can). Supported: one
    full-attention group (plain ``FullAttentionSpec``, the same per-layer KV size
    throughout), alone or beside sliding-window groups (``SlidingWindowSpec``). Refused,
    with every group's layer types named: Mamba or linear-attention state, cross or
    encoder-only attention, chunked local attention, MLA, attention sinks, layers whose
    KV sizes differ inside a group, and several full-attention groups (a model with
    fewer sliding than full layers: vLLM splits its full layers over groups of the
    sliding group's size)."""
    groups = kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    full = [i for i, spec in enumerate(specs) if _is_full(spec)]
    other = [i for i, spec in enumerate(specs) if not _is_full(spec) and not _is_sliding(spec)]
    differ = [
        i for i in range(len(specs)) if full and _geometry(specs[i]) != _geometry(specs[full[0]])
    ]
    if len(full) == 1 and not other and not differ:
        return []
    if not groups:
        return ["attention-free models (no KV cache group)"]
    reasons = []
    if other:
        reasons.append(
            "layer types other than full and sliding-window attention (vToken manages one"
            " full-attention group, beside sliding-window groups)"
        )
    if len(full) > 1:
        reasons.append(f"{len(full)} full-attention KV cache groups (vToken manages one)")
    if not full:
        reasons.append("no full-attention KV cache group")
    if differ and not other:
        sizes = sorted({str(_geometry(specs[i])[:3]) for i in [full[0], *differ]})
        reasons.append(
            "KV cache groups whose blocks differ (block size, KV heads, head size: "
            + ", ".join(sizes)
            + "; dtype or padded pages)"
        )
    return [f"this model's KV cache ({'; '.join(reasons)}): {describe_groups(kv_cache_config)}"]


def group_layout(kv_cache_config: Any) -> GroupLayout:
    """The ``GroupLayout`` of a config ``kv_group_problems`` accepts (``ValueError``
    naming the problem otherwise)."""
    problems = kv_group_problems(kv_cache_config)
    if problems:
        raise ValueError("; ".join(problems))
    groups = kv_cache_config.kv_cache_groups
    (full,) = [i for i, group in enumerate(groups) if _is_full(group.kv_cache_spec)]
    sliding = tuple(i for i in range(len(groups)) if i != full)
    return GroupLayout(
        full_group=full,
        sliding_groups=sliding,
        windows=tuple(int(groups[i].kv_cache_spec.sliding_window) for i in sliding),
        full_layer_names=tuple(groups[full].layer_names),
    )
