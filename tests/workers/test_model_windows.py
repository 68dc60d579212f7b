"""A model's sliding-window KV cache groups read from its config.json, without an engine
(``workers.model_windows``); the same on a real engine's layout is checked in
tests/workers/test_engine_hybrid.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from workers.model_windows import FULL, SLIDING, sliding_windows


def _write(folder: Path, config: dict[str, Any]) -> Path:
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _gemma3(num_layers: int, every: int = 6) -> list[str]:
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers)]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # The tiny test model: 2 sliding + 2 full layers, one group of each.
        ({"num_hidden_layers": 4, "sliding_window": 16, "layer_types": [SLIDING, FULL] * 2}, (16,)),
        # Gemma 3 270M: 15 sliding, 3 full -> groups of 3: five sliding groups + one full.
        ({"num_hidden_layers": 18, "sliding_window": 512, "layer_types": _gemma3(18)}, (512,) * 5),
        # Gemma 3 1B: 22 sliding, 4 full -> groups of 4: ceil(22 / 4) = 6 sliding groups.
        ({"num_hidden_layers": 26, "sliding_window": 512, "layer_types": _gemma3(26)}, (512,) * 6),
        # Gemma 3 4B (multimodal): the text config nested; 29 sliding, 5 full -> 6 + 1.
        (
            {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "text_config": {
                    "num_hidden_layers": 34,
                    "sliding_window": 1024,
                    "layer_types": _gemma3(34),
                },
            },
            (1024,) * 6,
        ),
        # An older Gemma 3 config: sliding_window_pattern instead of layer_types.
        ({"num_hidden_layers": 26, "sliding_window": 512, "sliding_window_pattern": 6}, (512,) * 6),
        # gpt-oss: alternating; 12 sliding + 13 full -> under 1.5x: groups of 13, padded.
        (
            {
                "num_hidden_layers": 25,
                "sliding_window": 128,
                "layer_types": [SLIDING, FULL] * 12 + [FULL],
            },
            (128,),
        ),
        # No sliding layers: one group, nothing to add.
        ({"num_hidden_layers": 4, "sliding_window": None, "layer_types": [FULL] * 4}, ()),
        ({"num_hidden_layers": 30, "hidden_size": 576}, ()),  # a Llama: no layer types
        ({"num_hidden_layers": 30, "sliding_window": 4096, "use_sliding_window": False}, ()),
        # A window of 0 or none: vLLM runs every layer as full attention.
        ({"num_hidden_layers": 2, "sliding_window": 0, "layer_types": [SLIDING, FULL]}, ()),
        ({"num_hidden_layers": 2, "layer_types": [SLIDING, FULL]}, ()),
        ({"sliding_window": 16}, ()),  # no layer types, no layer count: nothing slides
        # Configs as published, read through transformers as vLLM reads them: the layer
        # types come from transformers' defaults, the layer count from ``n_layer``.
        (
            {"model_type": "gemma2", "num_hidden_layers": 26, "sliding_window": 4096},
            (4096,),  # alternating: 13 sliding + 13 full, one group each
        ),
        ({"model_type": "gemma3_text", "num_hidden_layers": 26, "sliding_window": 512}, (512,) * 6),
        (
            {
                "model_type": "gemma3",
                "text_config": {
                    "model_type": "gemma3_text",
                    "num_hidden_layers": 34,
                    "sliding_window": 1024,
                },
                "vision_config": {"model_type": "siglip_vision_model"},
            },
            (1024,) * 6,
        ),
        ({"model_type": "gpt2", "n_layer": 12}, ()),
    ],
)
def test_sliding_windows_per_kv_cache_group(
    tmp_path: Path, config: dict[str, Any], expected: tuple[int, ...]
) -> None:
    assert sliding_windows(_write(tmp_path, config)) == expected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"num_hidden_layers": 4, "sliding_window": 16, "layer_types": [SLIDING, FULL]},
            "one type per layer",
        ),
        (
            {"num_hidden_layers": 2, "sliding_window": 16, "layer_types": [SLIDING, "mamba"]},
            "mamba",
        ),
        (
            {"num_hidden_layers": 2, "sliding_window": "wide", "layer_types": [SLIDING, FULL]},
            "no sliding_window",
        ),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_config_it_cannot_read_is_a_clear_error(
    tmp_path: Path, config: Any, message: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as error:
        sliding_windows(tmp_path)
    assert "config.json" in str(error.value)  # names the file
    with pytest.raises(ValueError, match="cannot read"):
        sliding_windows(tmp_path / "missing")


def test_gemma3_270m_has_five_sliding_groups(gemma3_path) -> None:
    """The shipped Gemma 3 270M's own config: six KV cache groups in vLLM 0.32
    (tests/workers/test_engine_gemma3.py), five of them sliding with the 512-token window."""
    assert sliding_windows(gemma3_path) == (512,) * 5
