"""The prompt as token ids and the request a replica is asked, without Redis or a replica."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.admission import Reservation
from controlplane.kv_bounds import SlidingWindows
from controlplane.models import TenantQuota
from controlplane.openai_models import ChatCompletionRequest, CompletionRequest
from serving.errors import HTTPError
from serving.replica_request import PromptEncoder, generate_request, hold_to_blocks

MODEL = "tiny"
BLOCK_SIZE = 4


class WordTokenizer:
    """One token per word: ``w<i>`` is token ``i``; a vocabulary of 100 tokens."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [int(word[1:]) for word in text.split()]}

    def __len__(self) -> int:
        return 100

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any:
        assert add_generation_prompt and tokenize
        ids = [int(w[1:]) for message in conversation for w in message["content"].split()]
        return {"input_ids": [*ids, 99]}  # 99: the assistant's turn


ENCODER = PromptEncoder(WordTokenizer(), MODEL, max_model_len=16)


def completion(prompt: str | list[int], **fields: Any) -> CompletionRequest:
    return CompletionRequest(model=MODEL, prompt=prompt, **fields)


def test_text_token_ids_and_chat_messages_are_encoded() -> None:
    assert ENCODER.ids(completion("w3 w1 w4", max_tokens=4)) == [3, 1, 4]
    assert ENCODER.ids(completion([7, 8], max_tokens=4)) == [7, 8]
    chat = ChatCompletionRequest(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=4
    )
    assert ENCODER.ids(chat) == [5, 6, 99]


def test_another_model_is_a_404() -> None:
    body = CompletionRequest(model="other", prompt="w1", max_tokens=1)
    with pytest.raises(HTTPError) as refused:
        ENCODER.ids(body)
    assert refused.value.status == 404


def test_a_token_id_outside_the_vocabulary_is_a_400() -> None:
    with pytest.raises(HTTPError) as refused:
        ENCODER.ids(completion([1, 100], max_tokens=1))
    assert refused.value.status == 400
    assert "token id 100 is outside the model's vocabulary of 100 tokens" in refused.value.message


def test_text_that_tokenizes_to_nothing_is_a_400() -> None:
    # Whitespace here; a real tokenizer drops some control characters (U+0016) the same way.
    with pytest.raises(HTTPError) as refused:
        ENCODER.ids(completion("   ", max_tokens=1))
    assert refused.value.status == 400
    assert "no tokens after tokenizing" in refused.value.message


def test_a_prompt_over_the_context_is_a_400_and_one_at_it_fits() -> None:
    assert len(ENCODER.ids(completion("w1 w2 w3 w4 w5 w6", max_tokens=10))) == 6
    with pytest.raises(HTTPError) as refused:
        ENCODER.ids(completion("w1 w2 w3 w4 w5 w6", max_tokens=11))
    assert refused.value.status == 400
    assert "prompt (6 tokens) + max_tokens (11) exceeds the model's context of 16" in (
        refused.value.message
    )


@pytest.mark.parametrize(
    ("steady", "n", "expected"),
    [
        (6, 2, None),  # worst case: 2 x ceil((5 + 6) / 4) = 6 blocks: no bound to hold
        (4, 2, 2),  # below the worst case: each sequence held to 4 // 2 blocks
        (3, 1, None),  # one sequence: worst case 3 blocks
        (2, 1, 2),
    ],
)
def test_the_steady_bound_is_held_only_below_the_worst_case(
    steady: int, n: int, expected: int | None
) -> None:
    worst_one = -(-(5 + 6) // BLOCK_SIZE)
    reservation = Reservation("acme", "r", blocks=n * worst_one, steady=steady)
    assert hold_to_blocks(reservation, 5, 6, n, BLOCK_SIZE) == expected


def test_the_generate_request_carries_the_body_the_quota_and_the_bound() -> None:
    quota = TenantQuota(
        tenant_id="acme", kv_budget_blocks=64, eviction_budget_tokens=32, weight=2.5
    )
    body = completion("w1", max_tokens=6, n=2, temperature=0.5, seed=3, stop=["w9"])
    ids = [1, 2, 3, 4, 5]
    reservation = Reservation("acme", "cmpl-1", blocks=6, steady=4)
    sent = generate_request(quota, "cmpl-1", ids, body, reservation, BLOCK_SIZE)
    assert (sent.request_id, sent.tenant_id, sent.prompt_token_ids) == ("cmpl-1", "acme", ids)
    assert sent.tenant_weight == 2.5  # the engine's fair order reads it
    assert (sent.max_tokens, sent.n, sent.temperature, sent.seed) == (6, 2, 0.5, 3)
    assert sent.stop == ["w9"]
    assert sent.eviction_budget_tokens == 32
    assert sent.hold_to_blocks == 2
    assert len(sent.prefix_keys) == len(ids) // BLOCK_SIZE  # one key per full block


def test_the_engine_holds_a_hybrid_requests_full_attention_group_without_its_windows() -> None:
    """Admission counted a sequence's sliding-window blocks (never evicted) in its steady
    bound; the engine's hold bound is on its full-attention group alone. 200 + 64 tokens,
    blocks of 32, one sliding group bounded at 4 blocks, a cap of 48 tokens: steady 3 + 4."""
    sliding = SlidingWindows((16,), in_flight_tokens=64, max_model_len=1024)
    held = Reservation("acme", "r", blocks=11, steady=7)
    assert hold_to_blocks(held, 200, 64, 1, 32, sliding) == 3
    assert hold_to_blocks(held, 200, 64, 1, 32) == 7  # without the windows: wrong by 4
    # n = 2 at the worst case (2 x (9 + 4)): nothing to hold.
    worst = Reservation("acme", "r", blocks=26, steady=26)
    assert hold_to_blocks(worst, 200, 64, 2, 32, sliding) is None
