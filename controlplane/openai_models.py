"""OpenAI-compatible request bodies (the subset vtoken serves) and the internal request
that crosses from the ingress to a replica.

Unknown fields from OpenAI clients are ignored, known ones are validated; a client-sent
``cache_salt`` is dropped: the server salts the prefix cache per tenant.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MaxTokens = Annotated[int, Field(ge=1, le=1_000_000)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: MaxTokens = 16
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=4)
    stream: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class CompletionRequest(_Body):
    prompt: str = Field(min_length=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: object) -> object:
        if isinstance(value, list):
            if len(value) != 1 or not isinstance(value[0], str):
                raise ValueError("prompt must be a string (batches of prompts are not served)")
            return value[0]
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


class GenerateRequest(BaseModel):
    """What the ingress sends a replica (after authentication and admission)."""

    request_id: str
    tenant_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    stop: list[str] | None = None
    eviction_budget_tokens: int | None = None  # the tenant's per-request KV cap (admission)
    trace_context: dict[str, str] = Field(default_factory=dict)


class GenerateChunk(BaseModel):
    """One streamed piece of a replica's answer; the last has ``finish_reason`` set."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    replica_id: str = ""
    error: str | None = None  # a request the replica refuses (e.g. prompt too long)
