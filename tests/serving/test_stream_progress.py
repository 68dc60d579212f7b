"""A stream's progress over its chunks: decode pace per sequence (prefill left out), the
first token's latency, when every sequence is past its prefill, and finished choices."""

from __future__ import annotations

import pytest

from controlplane.openai_models import GenerateChunk
from serving.stream_progress import ChunkTiming, StreamProgress, TokenPace


def _chunk(index: int, completion_tokens: int, finish: str | None = None) -> GenerateChunk:
    return GenerateChunk(index=index, completion_tokens=completion_tokens, finish_reason=finish)


def test_two_sequences_from_prefill_to_their_ends():
    progress = StreamProgress(num_sequences=2, started=100.0, seen_at=100.5)
    # The first token (it carries the prefill): a first-token latency, no decode sample.
    assert progress.observe(_chunk(0, 1), 102.0) == ChunkTiming(first_token_s=2.0)
    assert not progress.past_prefill  # choice 1 has no token out yet
    # Choice 1's first token: 3 tokens in all, 2 more in 1 s over 2 sequences.
    assert progress.observe(_chunk(1, 3), 103.0) == ChunkTiming(decode_s=1.0, decode_tokens=1.0)
    assert progress.past_prefill and not progress.all_finished
    # Nothing new (e.g. held-back text): no sample, no time moves.
    assert progress.observe(_chunk(0, 3), 104.0) == ChunkTiming()
    assert progress.seen_at == 103.0
    progress.observe(_chunk(0, 4, "stop"), 105.0)
    progress.observe(_chunk(1, 6, "length"), 106.0)
    assert progress.all_finished and progress.finished == {0, 1}
    assert (progress.first_token_at, progress.seen_at, progress.tokens_per_sequence) == (
        102.0,
        106.0,
        3,
    )


def test_a_stream_that_ends_without_its_finish_reasons_is_not_finished():
    progress = StreamProgress(num_sequences=1, started=0.0, seen_at=0.0)
    progress.observe(_chunk(0, 5), 1.0)
    assert progress.past_prefill and not progress.all_finished


def test_token_pace_is_a_moving_average_from_its_first_sample():
    pace = TokenPace(weight=0.5)
    assert pace.seconds_per_token is None
    pace.observe(2.0, 4)
    assert pace.seconds_per_token == 0.5
    pace.observe(-1.0, 1)  # a clock that went back counts as no time
    assert pace.seconds_per_token == pytest.approx(0.25)
