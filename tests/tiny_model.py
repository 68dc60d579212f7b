"""A tiny random Llama with SmolLM2's tokenizer: starts in seconds in vLLM, real text I/O."""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(folder: Path, tokenizer_source: Path, seed: int = 0) -> Path:
    """Save (once) a 2-layer Llama (hidden 128, 4 heads, 2 KV heads, head_dim 32)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
