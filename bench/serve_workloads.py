"""The request streams `vtoken bench serve` offers its engines (seeded; the seed and every
parameter go into the JSON), and each workload's preset of options.

- ``single``: prompts cut from CPython's own documentation (``pydoc_data.topics``), lengths
  from a Pareto distribution (shape ``PARETO_SHAPE``) truncated to [min, max] prompt tokens,
  outputs uniform in [min, max] new tokens (``ignore_eos``: every engine generates the same
  count); prefill-heavy.
- ``chat``: multi-turn conversations; each turn's prompt is the whole conversation so far
  (earlier prompts and the engine's own answers) plus a new user message; the next turn
  arrives a think time after the previous answer ends. Rates are conversations per second.
- ``reasoning``: short prompts and long outputs, as reasoning models run: prompt and
  output lengths uniform in their ranges. Decode-heavy: a request's KV grows for its whole
  life, so the pool binds once a few requests run at once.

Arrivals are a Poisson process at one request (conversation) per second; a trial at rate
``r`` scales the times by ``1 / r``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PARETO_SHAPE = 1.2
WORKLOADS = ("single", "chat", "reasoning")


@dataclass(frozen=True, slots=True)
class Turn:
    user: tuple[int, ...]  # the new prompt tokens of this turn
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation (a single request when it has one turn). ``start`` is its first
    arrival at one conversation per second; a trial at rate ``r`` scales it by ``1 / r``."""

    start: float
    turns: tuple[Turn, ...]
    think_s: float = 0.0

    def context_len(self, turns: int) -> int:
        """Tokens the prompt of turn ``turns`` (0-based) carries."""
        done = self.turns[:turns]
        return sum(len(t.user) + t.max_tokens for t in done) + len(self.turns[turns].user)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt and output) of any request."""
        return max(s.context_len(len(s.turns) - 1) + s.turns[-1].max_tokens for s in self.sessions)


def truncated_pareto(rng: random.Random, low: int, high: int, shape: float) -> int:
    """A Pareto(``shape``) length conditioned on ``[low, high]`` (inverse CDF)."""
    tail = (low / high) ** shape
    return min(high, int(low / (1.0 - rng.random() * (1.0 - tail)) ** (1.0 / shape)))


def _single_turns(
    name: str,
    corpus: Sequence[int],
    count: int,
    prompt_length: Any,
    output_range: tuple[int, int],
    seed: int,
    params: dict[str, Any],
) -> Workload:
    """``count`` one-turn sessions, Poisson arrivals, prompts of ``prompt_length(rng)``
    tokens cut from ``corpus`` at random offsets, outputs uniform in ``output_range``."""
    rng = random.Random(seed)
    sessions, clock = [], 0.0
    for _ in range(count):
        clock += rng.expovariate(1.0)
        length = prompt_length(rng)
        start = rng.randrange(len(corpus) - length)
        turn = Turn(tuple(corpus[start : start + length]), rng.randint(*output_range))
        sessions.append(Session(clock, (turn,)))
    return Workload(name, tuple(sessions), {**params, "seed": seed})


def single_workload(
    corpus: Sequence[int],
    count: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> Workload:
    params = {
        "requests": count,
        "prompt_tokens": list(prompt_range),
        "new_tokens": list(output_range),
        "prompt_distribution": f"pareto(shape={PARETO_SHAPE}) truncated to prompt_tokens",
    }

    def length(rng: random.Random) -> int:
        return truncated_pareto(rng, *prompt_range, PARETO_SHAPE)

    return _single_turns("single", corpus, count, length, output_range, seed, params)


def reasoning_workload(
    corpus: Sequence[int],
    count: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> Workload:
    """``count`` requests, prompts and outputs uniform in their (inclusive) ranges."""
    params = {
        "requests": count,
        "prompt_tokens": list(prompt_range),
        "new_tokens": list(output_range),
        "prompt_distribution": "uniform in prompt_tokens",
    }

    def length(rng: random.Random) -> int:
        return rng.randint(*prompt_range)

    return _single_turns("reasoning", corpus, count, length, output_range, seed, params)


def chat_workload(
    corpus: Sequence[int],
    count: int,
    turns: tuple[int, int],
    user_range: tuple[int, int],
    output_range: tuple[int, int],
    max_context: int,
    think_s: float,
    seed: int,
) -> Workload:
    """``count`` conversations of ``turns`` turns (fewer when the context would pass
    ``max_context``), user messages and answers of uniform lengths."""
    rng = random.Random(seed)
    sessions, clock = [], 0.0
    for _ in range(count):
        clock += rng.expovariate(1.0)
        chosen: list[Turn] = []
        context = 0
        for _ in range(rng.randint(*turns)):
            length = rng.randint(*user_range)
            answer = rng.randint(*output_range)
            if context + length + answer > max_context:
                break
            start = rng.randrange(len(corpus) - length)
            chosen.append(Turn(tuple(corpus[start : start + length]), answer))
            context += length + answer
        if chosen:  # a conversation whose first turn would not fit is left out
            sessions.append(Session(clock, tuple(chosen), think_s))
    params = {
        "conversations": count,
        "turns": list(turns),
        "user_tokens": list(user_range),
        "new_tokens": list(output_range),
        "max_context": max_context,
        "think_s": think_s,
        "seed": seed,
    }
    return Workload("chat", tuple(sessions), params)


# ---------------------------------------------------------------- presets


@dataclass(frozen=True, slots=True)
class Preset:
    """The defaults of `vtoken bench serve`'s options for a family of workloads (token
    ranges inclusive): single-turn prompts, outputs, chat user messages, turns per
    conversation and the longest conversation; requests (conversations) per trial; the
    pool (``None``: twice the longest request); vLLM's ``max_num_batched_tokens``; the
    TPOT SLO factor; the rate sweep and its bisection steps; the policies."""

    prompt_tokens: tuple[int, int]
    new_tokens: tuple[int, int]
    user_tokens: tuple[int, int]
    turns: tuple[int, int]
    max_context: int
    requests: int
    num_blocks: int | None
    max_num_batched_tokens: int
    tpot_factor: float
    rates: str
    bisect_steps: int
    policies: str


FULL = Preset(
    (128, 2048), (32, 256), (32, 256), (2, 6), 2048 + 256, 40, None, 2048, 3.0,
    "0.25,0.5,1,2", 2, "h2o:0.2,h2o:0.5,snapkv:0.2",
)  # fmt: skip
QUICK = Preset(
    (64, 256), (8, 16), (32, 96), (2, 3), 512, 40, None, 2048, 3.0,
    "0.25,0.5,1,2", 2, "h2o:0.2,h2o:0.5,snapkv:0.2",
)  # fmt: skip
# The reasoning example (prompts 192-320, outputs 512-1,024, 128 blocks, 256
# batched tokens, 64 requests) at a quarter of every length and of the pool, 24 requests:
# see ``bench.serve``'s docstring.
REASONING = Preset(
    (48, 80), (128, 256), (0, 0), (1, 1), 0, 24, 32, 64, 3.0,
    "0.5,1,2", 1, "random:0.2,h2o:0.2",
)  # fmt: skip
REASONING_QUICK = Preset(
    (48, 80), (48, 64), (0, 0), (1, 1), 0, 8, 16, 64, 3.0,
    "0.05,4", 0, "random:0.2,h2o:0.2",
)  # fmt: skip


def preset(workloads: Sequence[str], quick: bool) -> Preset:
    """The preset of a run of ``workloads`` (``reasoning`` runs alone: its pool and
    batched-token limit are not the others')."""
    if "reasoning" in workloads:
        return REASONING_QUICK if quick else REASONING
    return QUICK if quick else FULL
