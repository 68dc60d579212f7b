"""What a replica is asked: an OpenAI body's prompt as token ids, and the request built on them.

Pure (the tokenizer is the caller's): :class:`PromptEncoder` turns a completion's prompt
(text or token ids) or a chat's messages into token ids, refusing a body for another model
(404), a token id outside the vocabulary or a prompt that with ``max_tokens`` exceeds the
model's context (400); :func:`generate_request` builds the :class:`GenerateRequest` a
replica runs, held to the bound admission reserved (:func:`hold_to_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from controlplane.admission import Reservation
from controlplane.kv_bounds import NO_WINDOWS, SlidingWindows
from controlplane.models import TenantQuota
from controlplane.openai_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from controlplane.prefix import cache_salt, prefix_keys
from controlplane.tracing import inject_context
from serving.errors import HTTPError


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the ingress uses."""

    def __call__(self, text: str) -> Any: ...

    def __len__(self) -> int: ...  # the vocabulary's size, added tokens included

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class PromptEncoder:
    """A body's prompt as ``tokenizer``'s token ids, for ``model_name`` within a context of
    ``max_model_len`` tokens (prompt plus ``max_tokens``). CPU work: the ingress runs
    :meth:`ids` on its tokenizer pool."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int

    def ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The prompt's token ids; :class:`HTTPError` 404 for another model, 400 for a token
        id outside the vocabulary, a prompt with no tokens or one over the context."""
        if body.model != self.model_name:
            raise HTTPError(404, f"model {body.model!r} is not served here", "not_found")
        if isinstance(body, ChatCompletionRequest):
            messages = [m.model_dump() for m in body.messages]
            encoded: Any = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            encoded = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        elif isinstance(body.prompt, list):  # token ids: no tokenizing, the same limits
            encoded = body.prompt
            vocabulary = len(self.tokenizer)
            if max(encoded) >= vocabulary:
                raise HTTPError(
                    400,
                    f"prompt: token id {max(encoded)} is outside the model's vocabulary "
                    f"of {vocabulary} tokens",
                    "invalid_request",
                )
        else:
            encoded = self.tokenizer(body.prompt)["input_ids"]
        ids = [int(token) for token in encoded]
        if not ids:  # text of characters the tokenizer normalizes away (some control codes)
            raise HTTPError(
                400, "prompt: no tokens after tokenizing (the prompt is empty)", "invalid_request"
            )
        limit = self.max_model_len
        if len(ids) + body.max_tokens > limit:
            raise HTTPError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({body.max_tokens}) exceeds the "
                f"model's context of {limit} tokens",
                "invalid_request",
            )
        return ids


def generate_request(
    quota: TenantQuota,
    request_id: str,
    ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    reservation: Reservation,
    block_size: int,
    sliding: SlidingWindows = NO_WINDOWS,
) -> GenerateRequest:
    """What the replica is asked: the prompt's ids, the body's sampling, the tenant's
    cap and prefix group, the prompt's prefix keys (router affinity, per ``block_size``
    tokens), the bound the engine holds the request to (``sliding``: the model's
    sliding-window groups admission counted) and the trace to join (the current span's:
    call it inside the request's span)."""
    return GenerateRequest(
        request_id=request_id,
        tenant_id=quota.tenant_id,
        tenant_weight=quota.weight,
        prompt_token_ids=ids,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        sampling=body.sampling_extensions(),
        n=body.n,
        priority=body.priority,
        logprobs=body.num_logprobs,
        eviction_budget_tokens=quota.eviction_budget_tokens,
        prefix_group=quota.prefix_group,
        prefix_keys=list(
            prefix_keys(ids, block_size, cache_salt(quota.tenant_id, quota.prefix_group))
        ),
        hold_to_blocks=hold_to_blocks(
            reservation, len(ids), body.max_tokens, body.n, block_size, sliding
        ),
        trace_context=inject_context(),
    )


def hold_to_blocks(
    reservation: Reservation,
    prompt_tokens: int,
    max_tokens: int,
    n: int,
    block_size: int,
    sliding: SlidingWindows = NO_WINDOWS,
) -> int | None:
    """Each sequence's steady bound in blocks when admission counts it below its
    worst case (then the engine holds it there), else ``None``. The engine holds its
    full-attention group to it: the blocks admission counted for a hybrid model's
    sliding-window groups (``sliding``, never evicted from) are left out."""
    longest = prompt_tokens + max_tokens
    steady = reservation.steady - n * sliding.blocks(longest, block_size)
    worst = n * -(-longest // block_size)
    return steady // n if steady < worst else None
