"""Seeded workloads: who sends what, when.

A workload is a list of ``SimRequest`` in arrival order, drawn from one seed:

- **arrivals**: Poisson at ``rate`` requests/s over ``duration_s`` (exponential gaps);
- **tenants**: ``num_tenants``, tenant ``k`` (from 0) with a Zipf share ``1 / (k + 1)^s``;
- **token ids**: derived from ``(tenant, session, turn)`` only, so prefix hashes behave as
  real ones: every request of a tenant starts with that tenant's system prompt; a chat
  turn's prompt is the system prompt, every earlier turn (user message, then the reply
  the engine produced for it: ``output_tokens``, which the simulated engine emits), and
  the new user message.

Shapes (``KINDS``; log-normal lengths with the median and spread given, clipped):

- ``chat``: multi-turn sessions (1-6 turns, history carried), system prompt 256-1024,
  user messages median 120, replies median 200;
- ``long-context``: one turn, prompts log-uniform over 4k-32k, replies median 256;
- ``reasoning``: one turn, prompts median 600, outputs log-uniform over 1k-8k;
- ``sharegpt``: one turn, prompt median 250 and reply median 200, both spread 1.0: the
  shape of ShareGPT conversations (not the data set itself).

Every request is clipped to ``max_model_len`` (the oldest turns of a chat history go
first; then the prompt's head after the system prompt; then the output).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

KINDS = ("chat", "long-context", "reasoning", "sharegpt")
VOCAB = 30_000


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    tenant: str
    session: int
    turn: int
    arrival_s: float
    prompt: tuple[int, ...]
    output_tokens: tuple[int, ...]

    @property
    def max_tokens(self) -> int:
        return len(self.output_tokens)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: str
    rate: float  # requests per second
    duration_s: float
    seed: int = 0
    num_tenants: int = 8
    zipf_s: float = 1.1
    max_model_len: int = 32_768
    length_scale: float = 1.0  # multiplies every length (CPU runs use small models)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {self.kind!r}")
        if self.rate <= 0 or self.duration_s <= 0 or self.num_tenants < 1:
            raise ValueError("rate, duration_s and num_tenants must be positive")
        if self.max_model_len < 64 or not 0 < self.length_scale <= 1:
            raise ValueError("max_model_len must be >= 64 and length_scale in (0, 1]")


def _ids(*key: object, count: int) -> tuple[int, ...]:
    """``count`` token ids determined by ``key`` alone."""
    seed = zlib.crc32(repr(key).encode())
    return tuple(int(t) for t in np.random.default_rng(seed).integers(1, VOCAB, count))


@dataclass(slots=True)
class _Session:
    tenant: int
    session: int
    turns_left: int
    history: list[int] = field(default_factory=list)
    turn: int = 0


class _Lengths:
    def __init__(self, spec: WorkloadSpec, rng: np.random.Generator) -> None:
        self.spec, self.rng = spec, rng

    def lognormal(self, median: float, sigma: float, low: int, high: int) -> int:
        value = median * math.exp(sigma * self.rng.standard_normal()) * self.spec.length_scale
        return int(min(max(value, low), high * self.spec.length_scale))

    def log_uniform(self, low: float, high: float) -> int:
        scale = self.spec.length_scale
        return max(1, int(math.exp(self.rng.uniform(math.log(low), math.log(high))) * scale))

    def turn(self) -> tuple[int, int]:
        """(new prompt tokens, output tokens) of one turn."""
        kind = self.spec.kind
        if kind == "chat":
            return self.lognormal(120, 0.8, 8, 2048), self.lognormal(200, 0.7, 8, 2048)
        if kind == "long-context":
            return self.log_uniform(4096, 32768), self.lognormal(256, 0.5, 16, 1024)
        if kind == "reasoning":
            return self.lognormal(600, 0.6, 32, 4096), self.log_uniform(1024, 8192)
        return self.lognormal(250, 1.0, 4, 4096), self.lognormal(200, 1.0, 4, 2048)


def system_prompt(spec: WorkloadSpec, tenant: int) -> tuple[int, ...]:
    length = 256 + zlib.crc32(f"system/{tenant}".encode()) % 769  # 256-1024
    return _ids("system", spec.seed, tenant, count=max(1, int(length * spec.length_scale)))


def generate(spec: WorkloadSpec) -> list[SimRequest]:
    """The workload's requests in arrival order (module docstring)."""
    rng = np.random.default_rng([spec.seed, zlib.crc32(spec.kind.encode())])
    lengths = _Lengths(spec, rng)
    shares = 1.0 / np.arange(1, spec.num_tenants + 1) ** spec.zipf_s
    shares /= shares.sum()
    sessions: dict[int, list[_Session]] = {}
    requests: list[SimRequest] = []
    now, next_session = 0.0, 0
    while True:
        now += rng.exponential(1.0 / spec.rate)
        if now >= spec.duration_s:
            return requests
        tenant = int(rng.choice(spec.num_tenants, p=shares))
        open_sessions = sessions.setdefault(tenant, [])
        if spec.kind == "chat" and open_sessions and rng.random() < 0.6:
            session = open_sessions[int(rng.integers(len(open_sessions)))]
        else:
            turns = int(rng.integers(1, 7)) if spec.kind == "chat" else 1
            session = _Session(tenant, next_session, turns)
            next_session += 1
            open_sessions.append(session)
        new_tokens, output_len = lengths.turn()
        message = _ids("user", spec.seed, tenant, session.session, session.turn, count=new_tokens)
        prompt, output = _fit(
            system_prompt(spec, tenant), session.history, message, output_len, spec.max_model_len
        )
        request_id = f"t{tenant}-s{session.session}-u{session.turn}"
        reply = _ids("reply", spec.seed, tenant, session.session, session.turn, count=output)
        requests.append(
            SimRequest(request_id, f"tenant-{tenant}", session.session, session.turn, now,
                       prompt, reply)
        )  # fmt: skip
        session.history += [*message, *reply]
        session.turn += 1
        session.turns_left -= 1
        if session.turns_left == 0:
            open_sessions.remove(session)


def _fit(
    system: tuple[int, ...],
    history: list[int],
    message: tuple[int, ...],
    output_len: int,
    max_model_len: int,
) -> tuple[tuple[int, ...], int]:
    """The prompt and output length within ``max_model_len`` (module docstring)."""
    output_len = max(1, min(output_len, max_model_len // 4))
    room = max_model_len - output_len - len(system)
    body = [*history, *message]
    if room < 1:
        return tuple(system[: max_model_len - output_len]), output_len
    return (*system, *body[-room:]), output_len
