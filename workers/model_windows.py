"""A hybrid model's sliding-window KV cache groups, read from its Hugging Face config
without starting an engine: what the ingress's admission counts a request's sliding
layers at (``controlplane.kv_bounds.SlidingWindows``).

vLLM 0.32 groups layers whose KV caches share one page size
(``kv_cache_utils._get_kv_cache_groups_uniform_page_size``): one bucket per attention
kind (a sliding window per window size), buckets in the order their first layer comes;
the group size is the smallest bucket's layer count (the largest one's when it has
under 1.5 times as many), and each bucket splits into ``ceil(layers / group size)``
groups. Gemma 3 1B (26 layers, one full-attention layer in six): 4 full-attention
layers, 22 sliding ones, so six sliding groups of window 512 beside one full group.
The engine checks the layout it gets (``workers.vllm_patches.kv_groups``); this reading
must agree with it (a test compares them on a real engine).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (a multimodal Gemma 3 nests it under
    ``text_config``)."""
    text = config.get("text_config")
    if isinstance(text, dict):
        return text
    return config


def layer_windows(config: dict[str, Any]) -> list[int | None]:
    """Each decoder layer's sliding window in tokens, ``None`` for full attention, from a
    language model's config (its ``layer_types``, or an older Gemma 3's
    ``sliding_window_pattern``: every ``pattern``-th layer full). No window (``None`` or
    0, as vLLM reads it) or no layer types: every layer full attention (``[]`` when the
    layer count is unknown too). ``ValueError`` on what it cannot read."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    pattern = config.get("sliding_window_pattern")
    num_layers = config.get("num_hidden_layers")
    if not window:  # vLLM runs every layer as full attention
        types = None
    elif types is None and isinstance(pattern, int) and pattern > 0:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"the model config needs num_hidden_layers >= 1 (got {num_layers!r})")
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if types is None:
        return [None] * num_layers if isinstance(num_layers, int) and num_layers > 0 else []
    if not isinstance(types, list) or (isinstance(num_layers, int) and len(types) != num_layers):
        raise ValueError(
            f"the model config's layer_types must list one type per layer "
            f"({num_layers} layers, got {types!r})"
        )
    unknown = sorted({str(t) for t in types} - {SLIDING, FULL})
    if unknown:
        raise ValueError(
            f"layer types {unknown} in the model config: vToken runs full and "
            f"sliding-window attention ({FULL}, {SLIDING})"
        )
    if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(
            f"the model config has {SLIDING} layers but no sliding_window >= 1 (got {window!r})"
        )
    return [window if kind == SLIDING else None for kind in types]


def _as_transformers_reads_it(model_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config as vLLM gets it: through transformers, which fills in
    defaults a config file leaves out (Gemma 2's and Gemma 3's layer types, ``n_layer``
    as ``num_hidden_layers``). A config transformers cannot load (no ``model_type``) is
    read as written."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
    except (ValueError, KeyError, OSError):
        return _text_config(raw)
    names = ("num_hidden_layers", "sliding_window", "layer_types", "sliding_window_pattern")
    return {name: getattr(text, name, None) for name in names}


def group_windows(windows: list[int | None]) -> tuple[int, ...]:
    """The window of each sliding-window KV cache group, in vLLM's group order, given
    each layer's window (``None``: full attention); ``()`` when every layer is alike
    (one group) or none slides."""
    buckets: dict[int | None, int] = {}  # layer kind -> layers, in first-layer order
    for window in windows:
        buckets[window] = buckets.get(window, 0) + 1
    if len(buckets) < 2:
        return ()
    smallest, largest = min(buckets.values()), max(buckets.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[int | None] = []
    for window, count in buckets.items():
        groups += [window] * math.ceil(count / group_size)
    return tuple(window for window in groups if window is not None)


def sliding_windows(model_dir: str | Path) -> tuple[int, ...]:
    """The sliding windows in tokens of the model in ``model_dir`` (its ``config.json``),
    one per sliding-window KV cache group as vLLM 0.32 forms them; ``()`` for a model
    without sliding-window layers. ``ValueError`` naming the file on a config it cannot
    read."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the model config {path}: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"the model config {path} is not a JSON object")
    try:
        return group_windows(layer_windows(_as_transformers_reads_it(path.parent, config)))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
