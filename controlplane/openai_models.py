"""OpenAI-compatible request bodies (what vtoken serves of OpenAI's and vLLM's APIs) and
the internal request that crosses from the ingress to a replica.

Contract of the bodies: OpenAI's fields and vLLM's sampling extensions
(:class:`controlplane.vllm_fields.SamplingExtensions`: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...) are served;
a field of either API this server does not serve (``best_of``, ``echo``,
``use_beam_search``, ``tools``, ``response_format``, ...: ``vllm_fields.REFUSED_FIELDS``)
is a validation error naming it and saying why, unless sent at the value that asks for
nothing; any other field is a validation error naming it, never silently ignored. A
completion's ``prompt`` is a string or token ids (a list of ints, or a list holding one
string or one list of ints, as vLLM's server takes them). ``n`` asks for several choices
(sampled: ``n > 1`` needs a temperature above 0; the ingress bounds it by its configured
maximum); log-probabilities are an integer ``logprobs`` (0..5 alternatives) for
completions and ``logprobs: true`` with ``top_logprobs`` (0..5) for chat, as in vLLM's
OpenAI server. ``null`` means "the default", as in OpenAI's API. A client-sent
``cache_salt`` is accepted and dropped: the server salts the prefix cache per tenant. Stop
strings are bounded in number and length. ``priority`` is vLLM's (an integer, lower
served first), honoured when the engines run vLLM's ``priority`` scheduling policy; the
ingress refuses any other value than 0 otherwise.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from controlplane.models import PrefixGroup
from controlplane.prefix import MAX_PREFIX_BLOCKS
from controlplane.vllm_fields import (
    REFUSED_CHAT_FIELDS,
    REFUSED_COMPLETION_FIELDS,
    SamplingExtensions,
    TokenId,
    drop_refused,
)

MaxTokens = Annotated[StrictInt, Field(ge=1, le=1_000_000)]
MAX_STOP_SEQUENCES = 4  # OpenAI's own limit
MAX_STOP_CHARS = 256  # each stop string is matched against the output at every step
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MAX_LOGPROBS = 5  # alternatives per token (OpenAI's completions limit)
MAX_N = 128  # choices any body may ask for; the ingress serves up to its own maximum
DEFAULT_MAX_N = 8  # that maximum unless configured
MAX_PRIORITY = 2**31 - 1  # vLLM's request priority, either sign
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]


MESSAGE_OVERHEAD_CHARS = 32
"""What the chat template adds around each message (role markers, separators), counted
toward the prompt limit: 60,000 one-character messages are a 2 MB prompt, not 60,000
characters."""


def prompt_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a raw (unvalidated) completion or chat body: the
    ``prompt`` string(s), or every message's text content plus ``MESSAGE_OVERHEAD_CHARS``
    per message. Anything else counts 0, so this is safe on any JSON object and cheap next
    to tokenizing."""

    def text(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):
            return sum(text(item) for item in value)
        if isinstance(value, dict):
            return text(value.get("text")) + text(value.get("content"))
        return 0

    messages = body.get("messages")
    overhead = MESSAGE_OVERHEAD_CHARS * len(messages) if isinstance(messages, list) else 0
    return text(body.get("prompt")) + text(messages) + overhead


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk, before ``[DONE]``,
    with no choices and the answer's usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Body(SamplingExtensions):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    refused: ClassVar[dict[str, tuple[Any, str]]] = REFUSED_COMPLETION_FIELDS

    model: str = Field(min_length=1, max_length=256)
    max_tokens: MaxTokens = 16
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)  # the end user, for the client
    cache_salt: str | None = Field(default=None, exclude=True, max_length=256)  # dropped
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    priority: StrictInt = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """vLLM's request priority: under the engines' ``scheduling_policy: priority`` a lower
    value is scheduled first (and preempted last); otherwise only 0 is served."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = {key: value for key, value in data.items() if value is not None}
            return drop_refused(given, cls.refused)
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("n")
    @classmethod
    def _sampled_choices(cls, value: int, info: ValidationInfo) -> int:
        # Greedy decoding gives n identical choices: vLLM refuses it, so does the body.
        if value > 1 and info.data.get("temperature", 1.0) == 0:
            raise ValueError("n > 1 needs sampling: a temperature above 0")
        return value

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> _Body:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

    def sampling_extensions(self) -> SamplingExtensions:
        """vLLM's sampling extensions of this body, for the engine."""
        return SamplingExtensions.model_validate(
            self.model_dump(include=set(SamplingExtensions.model_fields))
        )


class CompletionRequest(_Body):
    prompt: str | list[TokenId] = Field(min_length=1)
    """Text, or token ids that skip tokenizing (vLLM's token-id prompts)."""
    logprobs: TopLogprobs | None = None  # the sampled token's and this many alternatives'

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine returns (vLLM's ``SamplingParams.logprobs``);
        ``None``: no log-probabilities."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: object) -> object:
        # vLLM's forms: "text", [ids...], ["text"], [[ids...]]; batches are not served.
        if isinstance(value, list) and value and not isinstance(value[0], int):
            if len(value) != 1 or not isinstance(value[0], str | list):
                raise ValueError(
                    "prompt must be a string or token ids (batches of prompts are not served)"
                )
            return value[0]
        return value


class TextPart(BaseModel):
    """One part of a message's content; only text is served."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A chat message; list content is joined from its text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = Field(default=None, max_length=256, exclude=True)  # accepted, unused

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: object) -> object:
        if isinstance(value, list):
            return "".join(TextPart.model_validate(part).text for part in value)
        return value


class ChatCompletionRequest(_Body):
    refused: ClassVar[dict[str, tuple[Any, str]]] = REFUSED_CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    max_completion_tokens: MaxTokens | None = Field(default=None, exclude=True)
    """OpenAI's newer name of ``max_tokens``; it wins when both are sent (as in vLLM)."""

    @model_validator(mode="before")
    @classmethod
    def _max_completion_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_completion_tokens") is not None:
            return {**data, "max_tokens": data["max_completion_tokens"]}
        return data

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(BaseModel):
    """What the ingress sends a replica (after authentication and admission)."""

    request_id: str
    tenant_id: str
    tenant_weight: float = Field(default=1.0, ge=1e-3, le=1000, allow_inf_nan=False)
    """The tenant's weight (``TenantLimits.weight``): its share in the engine's fair order."""
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    stop: list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    sampling: SamplingExtensions = Field(default_factory=SamplingExtensions)
    """vLLM's sampling extensions, passed to ``SamplingParams`` as vLLM's server does."""
    n: int = Field(default=1, ge=1)  # choices: vLLM runs each as its own sequence
    priority: int = 0  # vLLM's (lower first), under the engines' ``priority`` policy
    logprobs: int | None = Field(default=None, ge=0)  # alternatives per token; None: none
    eviction_budget_tokens: int | None = None  # the tenant's per-request KV cap (admission)
    hold_to_blocks: int | None = Field(default=None, ge=1)
    """The blocks admission counts each sequence at once its prefill ends (active-KV
    admission's steady bound), when that is less than its prompt + ``max_tokens``: the
    engine evicts a sequence that holds more, at any step and in any eviction mode."""
    prefix_group: PrefixGroup | None = None
    """The tenant's prefix-cache group (``TenantLimits.prefix_group``): the replica salts
    the prompt with the group instead of the tenant (``controlplane.prefix.cache_salt``)."""
    prefix_keys: list[str] = Field(default_factory=list, max_length=MAX_PREFIX_BLOCKS)
    """The prompt's prefix keys (``controlplane.prefix.prefix_keys``, computed once at the
    ingress): the router sends the request where they are cached."""
    trace_context: dict[str, str] = Field(default_factory=dict)


class TokenLogprob(BaseModel):
    """One generated token's log-probability as the engine gave it: ``token`` decoded,
    ``logprob`` (clamped at -9999, JSON has no -inf; ``None`` when the engine gave none)
    and ``top``, the engine's alternatives in its order (the sampled token first, then the
    most likely ones: up to ``logprobs + 1`` entries); the ingress shapes them into the
    completions or the chat ``logprobs`` object."""

    token: str
    logprob: float | None = None
    top: list[tuple[str, float]] | None = None


class GenerateChunk(BaseModel):
    """One streamed piece of one choice (``index``) of a replica's answer; each choice's
    last piece has ``finish_reason`` set. ``completion_tokens`` counts every choice's
    tokens so far (the answer's usage); ``logprobs`` covers this piece's tokens when the
    request asked for them."""

    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the replica's prefix cache served
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    replica_id: str = ""
    error: str | None = None  # a request the replica refuses (e.g. prompt too long)
