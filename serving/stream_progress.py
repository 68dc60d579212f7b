"""How far an answer's stream has come, and the token paces the ingress learns from streams.

Pure bookkeeping over the replica's chunks (the times are the caller's clock): the
pipeline (:mod:`serving.openai_http`) feeds each chunk to a :class:`StreamProgress`, which
says what it measured (:class:`ChunkTiming`) and when every sequence is past its prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.openai_models import GenerateChunk


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """What one chunk measured. ``decode_s`` seconds passed for ``decode_tokens`` new tokens
    per sequence (``None``: the chunk carried no decode step, e.g. the first token, which
    carries the prefill); ``first_token_s``: seconds from arrival to the answer's first
    token, on the chunk that brought it (else ``None``)."""

    decode_s: float | None = None
    decode_tokens: float = 0.0
    first_token_s: float | None = None


@dataclass(slots=True)
class StreamProgress:
    """One answer's progress over its ``num_sequences`` choices, from ``started`` (arrival).

    ``tokens_seen`` counts completion tokens of all choices (the chunks' running total),
    last grown at ``seen_at``; ``first_token_at`` is when the first one came (``None``
    before). ``decoding``: the choices with a token out (past their prefill);
    ``finished``: the choices with their finish reason."""

    num_sequences: int
    started: float
    seen_at: float
    tokens_seen: int = 0
    first_token_at: float | None = None
    decoding: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)

    def observe(self, chunk: GenerateChunk, now: float) -> ChunkTiming:
        """Take ``chunk`` in, received at ``now``."""
        decode_s, decode_tokens, first_token_s = None, 0.0, None
        grown = chunk.completion_tokens - self.tokens_seen
        if self.tokens_seen and grown > 0:  # decode, not prefill
            # The n sequences decode side by side: each step adds about n tokens.
            decode_s, decode_tokens = now - self.seen_at, grown / self.num_sequences
        if grown > 0:
            self.tokens_seen, self.seen_at = chunk.completion_tokens, now
            if self.first_token_at is None:
                self.first_token_at = now
                first_token_s = now - self.started
        if chunk.completion_tokens:  # a piece of this choice: its prefill is over
            self.decoding.add(chunk.index)
        if chunk.finish_reason is not None:
            self.finished.add(chunk.index)
        return ChunkTiming(decode_s, decode_tokens, first_token_s)

    @property
    def past_prefill(self) -> bool:
        """Every sequence has a token out, so no prefill is left: the policy bounds the KV."""
        return len(self.decoding) >= self.num_sequences

    @property
    def all_finished(self) -> bool:
        """Every choice ended with a finish reason (a vanished replica leaves some without)."""
        return len(self.finished) >= self.num_sequences

    @property
    def tokens_per_sequence(self) -> int:
        return round(self.tokens_seen / self.num_sequences)


class TokenPace:
    """An exponential moving average of seconds per token. The ingress keeps two: time per
    output token of the answers it streams (over decode chunks; the first chunk, which
    carries the prefill, is left out), and time from arrival to first token (per request:
    one "token"). ``seconds_per_token`` is ``None`` until a sample was seen."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.seconds_per_token: float | None = None

    def observe(self, seconds: float, num_tokens: float) -> None:
        sample = max(seconds, 0.0) / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = (
            sample if previous is None else previous + self.weight * (sample - previous)
        )
