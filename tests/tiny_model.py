"""A tiny random Llama (2 layers, hidden 128, 4 heads, 2 KV heads, head_dim 32) that
starts in seconds in vLLM; with a tokenizer source it speaks real text."""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(folder: Path, tokenizer_source: Path | None = None, seed: int = 0) -> Path:
    """Save the model once into ``folder``. Without ``tokenizer_source`` the vocabulary
    is 512 ids and there is no tokenizer (engines run with ``skip_tokenizer_init``)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source) if tokenizer_source else None
    special = (
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        if tokenizer is not None
        else {}
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer) if tokenizer is not None else 512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=tokenizer is not None,
        **special,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
