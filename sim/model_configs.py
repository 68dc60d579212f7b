"""Model folders holding only ``config.json``: what vLLM's config needs to build a scheduler
for a model whose weights are never loaded (``sim.replica.build_scheduler``)."""

from __future__ import annotations

import json
from pathlib import Path

from sim.cost_model import MODELS, ModelShape


def llama_config(shape: ModelShape, max_position_embeddings: int = 131_072) -> dict[str, object]:
    """A Hugging Face ``LlamaConfig`` dict with ``shape``'s sizes (Llama 3.1's 128k
    positions; its RoPE scaling is left out: the scheduler never reads it)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500_000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def model_folder(model: str, root: Path) -> str:
    """``root/<model>`` holding the config of ``MODELS[model]`` (written once)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    folder = root / model
    path = folder / "config.json"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(llama_config(MODELS[model]), indent=1))
    return str(folder)
