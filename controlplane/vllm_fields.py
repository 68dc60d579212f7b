"""vLLM's extensions of the OpenAI request bodies: the sampling fields vLLM's OpenAI server
accepts beyond OpenAI's (served, passed to the engine as vLLM's server passes them), and
the fields of either API this server refuses, each with why.

A refused field sent at the value that asks for nothing (``use_beam_search: false``,
``add_special_tokens: true`` on completions, ...) is accepted and dropped,
so clients that always send vLLM's defaults keep working; any other value is a 400 that
names the field and says why. A field neither API defines stays a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from pydantic_core import PydanticCustomError

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
MAX_STOP_TOKEN_IDS = 64  # each is compared with every generated token
MAX_BAD_WORDS = 64  # each is tokenized by the engine when the request arrives
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 262_144  # a whole vocabulary of today's models
MAX_LOGIT_BIAS = 300  # OpenAI's own limit
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class SamplingExtensions(BaseModel):
    """vLLM's sampling extensions (and OpenAI's ``logit_bias``), with vLLM's defaults. The
    engine gets them as keyword arguments of ``vllm.SamplingParams`` of the same names, as
    vLLM's OpenAI server passes them (:meth:`engine_kwargs`). None of them changes the KV a
    request holds beyond what admission counts (``ignore_eos`` and ``min_tokens`` stay
    within ``max_tokens``). Token ids out of the model's vocabulary are refused by the
    engine (HTTP 400)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    top_k: StrictInt = Field(default=0, ge=-1, le=2**31 - 1)  # 0 or -1: every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: StrictInt = Field(default=0, ge=0, le=1_000_000)
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    bad_words: list[BadWord] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    logit_bias: dict[str, Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    """OpenAI's: token id (a string of digits) -> bias added to its logit."""
    stream_interval: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    """Tokens per streamed chunk (vLLM's ``stream_interval``)."""

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or int(key) > 2**31 - 1:
                raise ValueError(f"keys must be token ids (got {key[:32]!r})")
        return value

    def engine_kwargs(self) -> dict[str, Any]:
        """``vllm.SamplingParams`` keyword arguments (``logit_bias`` keyed by int)."""
        kwargs = self.model_dump(exclude={"logit_bias"})
        if self.logit_bias is not None:
            kwargs["logit_bias"] = {int(key): bias for key, bias in self.logit_bias.items()}
        return kwargs


_BEAM = "beam search runs more sequences than admission reserves"
_GUIDED = "guided decoding (structured outputs) is not served by vToken's engines"
_SHAPE = "answers have OpenAI's shape only"
_TEMPLATE = "the server applies the model's own chat template"
_DISAGGREGATED = "disaggregated prefill is not served"

REFUSED_FIELDS: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, _BEAM),
    "length_penalty": (1.0, "only beam search uses it, and " + _BEAM),
    "best_of": (1, "it runs more sequences than it returns, beyond what admission reserves"),
    "echo": (False, _SHAPE),
    "response_format": ({"type": "text"}, _GUIDED),
    "structured_outputs": ({}, _GUIDED),
    "prompt_logprobs": (None, "it computes the vocabulary's logits over every prompt token"),
    "logprob_token_ids": ([], "only the top alternatives are served (logprobs)"),
    "truncate_prompt_tokens": (None, "prompts are never truncated: a longer one is a 400"),
    "truncation_side": (None, "prompts are never truncated: a longer one is a 400"),
    "request_id": (None, "the server names each request (its id is in the answer)"),
    "session_id": (None, "sessions are not tracked"),
    "return_tokens_as_token_ids": (False, _SHAPE),
    "return_token_ids": (False, _SHAPE),
    "return_token_offsets": (False, _SHAPE),
    "return_prompt_text": (False, _SHAPE),
    "routed_experts_prompt_start": (0, _SHAPE),
    "mm_payload": ("tensors", "multimodal inputs are not served"),
    "return_mm_kwargs": (None, "multimodal inputs are not served"),
    "prompt_embeds": (None, "prompt embeddings are not served"),
    "kv_transfer_params": (None, _DISAGGREGATED),
    "ec_transfer_params": (None, _DISAGGREGATED),
    "vllm_xargs": (None, "the engine's per-request arguments carry the tenant's policy"),
    "repetition_detection": (None, "not served"),
    "thinking_token_budget": (None, "reasoning budgets are not served"),
    "watermarking": (False, "not served"),
    "suffix": (None, "insertion is not served"),
}
"""Fields of OpenAI's or vLLM's request bodies this server refuses: name -> (the value that
asks for nothing, accepted and dropped; why any other value is refused)."""

REFUSED_COMPLETION_FIELDS = {
    **REFUSED_FIELDS,
    "add_special_tokens": (True, "the server tokenizes as vLLM does by default"),
}
REFUSED_CHAT_FIELDS = {
    **REFUSED_FIELDS,
    "add_special_tokens": (False, _TEMPLATE),
    "add_generation_prompt": (True, _TEMPLATE),
    "continue_final_message": (False, _TEMPLATE),
    "chat_template": (None, _TEMPLATE),
    "chat_template_kwargs": ({}, _TEMPLATE),
    "documents": ([], _TEMPLATE),
    "media_io_kwargs": ({}, "multimodal inputs are not served"),
    "mm_processor_kwargs": ({}, "multimodal inputs are not served"),
    "tools": ([], "tool calling is not served"),
    "tool_choice": ("none", "tool calling is not served"),
    "parallel_tool_calls": (True, "tool calling is not served"),
    "reasoning_effort": (None, "reasoning is not served"),
    "include_reasoning": (True, "reasoning is not served"),
}


def drop_refused(data: dict[str, Any], refused: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """``data`` without the refused fields sent at the value that asks for nothing; a
    ``PydanticCustomError`` naming the first one sent at any other value, and why."""
    kept = {}
    for name, value in data.items():
        if name not in refused:
            kept[name] = value
            continue
        harmless, why = refused[name]
        if value != harmless or isinstance(value, bool) != isinstance(harmless, bool):
            raise PydanticCustomError(
                "not_served", "{field}: not served here: {why}", {"field": name, "why": why}
            )
    return kept
