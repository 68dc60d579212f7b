"""`vtoken bench prefix`: prefix-cache hits, TTFT and goodput through the whole Serve stack,
per router and with prefix caching on or off.

The command starts the stack itself (a ``redis-server``, local Ray, the Serve app: ingress
with admission, ``--replicas`` vLLM CPU engines with SmolLM2 and vToken, the controller)
once per *setting*, one after the other, on the same seeded workload:

- ``vtoken``: the project's router (``VTokenRequestRouter``: prefix affinity with bounded
  loads, then the tenant's warm set; ``controlplane/router.py``);
- ``serve_default``: Ray Serve's default router (power of two choices on queue length);
- ``serve_prefix_cache_affinity``: Ray Serve's ``PrefixCacheAffinityRouter``
  (``serving/prefix_router.py``);

each with the engines' prefix caching on, plus ``vtoken`` with it off. The engines run H2O
at keep 0.5, evicting on demand (serving's default), with the system prompt's tokens
pinned (``prefix_pin_tokens``); admission is active-KV, so a request is held to its
steady bound (``hold_to_blocks``) and evicts from its first decoding step.

What to pin is measured apart (``--pin-check``, one in-process engine, no stack, one
conversation per tenant so that nothing else shares its system prompt): the same
conversations turn by turn, H2O at keep 0.5 evicting *eagerly* and StreamingLLM (every
request evicts from its first decoding step, so only what lies below its first eviction
stays cached), with the system prompt pinned or nothing pinned, and H2O with cache hits
pinned too (``pin_cache_hits``), against vanilla vLLM's prefix cache.

Workload: ``--tenants`` tenants, each with its own system prompt of ``--system-tokens``
tokens of CPython's documentation; each tenant runs ``--conversations`` conversations of
``--turns`` turns; a turn's prompt is the system prompt, the whole conversation so far
(the engine's own answers included) and a new user message of ``--user-tokens`` tokens.
Conversations start at Poisson times (the trial's rate); a conversation's next turn is
sent ``THINK_S`` after its answer (streamed, with its usage: OpenAI's ``stream_options``).

Per request, from the client: TTFT, TPOT, the prompt tokens the replica's prefix cache
served (``usage.prompt_tokens_details.cached_tokens``), and the *ideal*: its longest token
prefix shared with an earlier prompt and its answer of the same tenant, in whole blocks
(what a cache of unlimited size on a single replica would serve). ``hit_rate`` = cached /
prompt tokens, ``hit_rate_of_ideal`` = cached / ideal. SLOs as the goodput benchmark's:
TTFT <= 5x and TPOT <= 3x the unloaded p50, measured once at the start of the run (first
setting, prompts that share nothing with the workload). Goodput: the highest request rate
up to which every rate of ``--rates`` had >= 90% of requests meeting both (a coarse
sweep, not a bisection: ``at_least`` when the top rate passed).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import (
    SLO_ATTAINMENT,
    TPOT_SLO_FACTOR,
    TTFT_SLO_FACTOR,
    Slo,
    csv_items,
    doc_tokens,
    percentile,
    pyplot,
    ratio,
    save_figure,
    write_json,
)

SETTINGS = ("vtoken:on", "serve_default:on", "serve_prefix_cache_affinity:on", "vtoken:off")
THINK_S = 1.0
BLOCK_SIZE = 32
UNLOADED_PROBES = 4


def vtoken_config(pin_tokens: int, pin_cache_hits: bool = False) -> dict[str, Any]:
    return {
        "policy": "h2o",
        "keep_ratio": 0.5,
        "eviction": "on_demand",
        "prefix_pin_tokens": pin_tokens,
        "pin_cache_hits": pin_cache_hits,
    }


@dataclass(frozen=True)
class Setting:
    router: str
    prefix_caching: bool
    pin_cache_hits: bool = False

    @classmethod
    def parse(cls, text: str) -> Setting:
        parts = text.split(":")
        router, caching = parts[0], parts[1] if len(parts) > 1 else "on"
        if router not in ("vtoken", "serve_default", "serve_prefix_cache_affinity"):
            raise typer.BadParameter(f"unknown router {router!r} in setting {text!r}")
        if caching not in ("on", "off") or parts[2:] not in ([], ["pinhits"]):
            raise typer.BadParameter(f"a setting is router:on|off[:pinhits], got {text!r}")
        return cls(router, caching == "on", pin_cache_hits=parts[2:] == ["pinhits"])

    @property
    def name(self) -> str:
        pin = ":pinhits" if self.pin_cache_hits else ""
        return f"{self.router}:{'on' if self.prefix_caching else 'off'}{pin}"


# ---------------------------------------------------------------- workload
@dataclass(frozen=True)
class Conversation:
    tenant: str
    system: str
    user_turns: tuple[str, ...]
    start_s: float


def make_workload(
    tokenizer: Any,
    tenants: int,
    conversations: int,
    turns: int,
    system_tokens: int,
    user_tokens: int,
    rate: float,
    seed: int,
) -> list[Conversation]:
    """Seeded conversations: tenant ``t``'s system prompt is its own slice of the
    documentation; user messages are further slices; starts are Poisson at ``rate``/s."""
    corpus = doc_tokens(tokenizer)
    rng = random.Random(seed)
    systems = [
        str(tokenizer.decode(corpus[t * system_tokens : (t + 1) * system_tokens]))
        for t in range(tenants)
    ]
    user_start = tenants * system_tokens
    order = [t for t in range(tenants) for _ in range(conversations)]
    rng.shuffle(order)
    clock = 0.0
    workload = []
    for tenant in order:
        clock += rng.expovariate(rate)
        users = []
        for _ in range(turns):
            at = user_start + rng.randrange(0, len(corpus) - user_start - user_tokens)
            users.append(str(tokenizer.decode(corpus[at : at + user_tokens])))
        workload.append(Conversation(f"tenant-{tenant}", systems[tenant], tuple(users), clock))
    return workload


def turn_prompt(system: str, history: Sequence[tuple[str, str]], user: str) -> str:
    parts = [system]
    for asked, answered in history:
        parts.append(f"\n\nUser: {asked}\nAssistant:{answered}")
    parts.append(f"\n\nUser: {user}\nAssistant:")
    return "".join(parts)


# ---------------------------------------------------------------- client
@dataclass
class Outcome:
    tenant: str
    prompt: str
    ttft_s: float
    tpot_s: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    sent_s: float
    text: str = ""


@dataclass
class Trial:
    setting: str
    rate: float
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


async def stream_completion(
    client: Any, key: str, prompt: str, max_tokens: int, tenant: str
) -> Outcome:
    """One streamed completion: TTFT at the first piece with text, usage at the end."""
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    texts: list[str] = []
    usage: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter()
                    texts.append(choice["text"])
    ended = time.perf_counter()
    ttft = (first if first is not None else ended) - started
    out = int(usage.get("completion_tokens", 0))
    return Outcome(
        tenant=tenant,
        prompt=prompt,
        ttft_s=ttft,
        tpot_s=(ended - started - ttft) / (out - 1) if out > 1 else None,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)),
        completion_tokens=out,
        sent_s=started,
        text="".join(texts),
    )


async def run_trial(
    base_url: str, keys: dict[str, str], workload: list[Conversation], max_tokens: int, trial: Trial
) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        began = time.perf_counter()

        async def converse(conversation: Conversation) -> None:
            await asyncio.sleep(max(0.0, began + conversation.start_s - time.perf_counter()))
            history: list[tuple[str, str]] = []
            for user in conversation.user_turns:
                prompt = turn_prompt(conversation.system, history, user)
                try:
                    outcome = await stream_completion(
                        client, keys[conversation.tenant], prompt, max_tokens, conversation.tenant
                    )
                except Exception as error:  # reported in the JSON, never hidden
                    trial.errors.append(f"{type(error).__name__}: {error}")
                    return
                trial.outcomes.append(outcome)
                history.append((user, outcome.text))
                await asyncio.sleep(THINK_S)

        await asyncio.gather(*(converse(c) for c in workload))
        trial.wall_s = time.perf_counter() - began


async def create_tenants(base_url: str, tenants: Sequence[str]) -> dict[str, str]:
    """One tenant per name with a budget that never binds; their API keys."""
    import httpx

    from serving.demo import ADMIN_TOKEN

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    keys = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for tenant in tenants:
            response = await client.put(
                f"/admin/tenants/{tenant}", json={"kv_budget_blocks": 100_000}, headers=admin
            )
            response.raise_for_status()
            keys[tenant] = str(response.json()["api_key"])
    return keys


# ---------------------------------------------------------------- figures
def ideal_cached_tokens(
    tokenizer: Any,
    outcomes: Sequence[Outcome],
    block_size: int,
    seen: dict[str, list[list[int]]] | None = None,
) -> list[int]:
    """Per outcome (in send order): its longest token prefix shared with an earlier prompt
    and answer of its tenant (vLLM caches the answer's blocks too), in whole blocks, at
    most its prompt minus one token (vLLM recomputes a prompt's last token). ``seen``
    (tenant -> earlier prompts' and answers' ids) carries those of earlier trials on the
    same engines, and is extended with these."""
    seen = {} if seen is None else seen
    ideal = []
    for outcome in sorted(outcomes, key=lambda o: o.sent_s):
        ids = list(tokenizer(outcome.prompt)["input_ids"])
        best = 0
        for earlier in seen.get(outcome.tenant, []):
            common = 0
            for a, b in zip(ids, earlier, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        best = min(best, len(ids) - 1)
        ideal.append(best - best % block_size)
        seen.setdefault(outcome.tenant, []).append(
            list(tokenizer(outcome.prompt + outcome.text)["input_ids"])
        )
        outcome.prompt_tokens = outcome.prompt_tokens or len(ids)
    return ideal


@dataclass(frozen=True, slots=True)
class TrialRow:
    """One trial's figures (a setting's ``per_rate``): hit rates over its requests,
    latencies over those that finished; ``requests`` counts the failed ones too."""

    conversation_rate: float
    request_rate: float
    requests: int
    errors: list[str]
    slo_attainment: float
    passed: bool
    hit_rate: float | None
    hit_rate_of_ideal: float | None
    cached_tokens: int
    ideal_cached_tokens: int
    prompt_tokens: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    wall_s: float


@dataclass(frozen=True, slots=True)
class SettingRow:
    """One setting's figures (the JSON's ``routers``)."""

    router: str
    prefix_caching: bool
    pin_cache_hits: bool
    setting: str
    goodput_rps: float
    goodput_bound: str  # at_least (every rate passed), sweep, below_lowest
    hit_rate: float | None
    hit_rate_of_ideal: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    per_rate: list[TrialRow]


@dataclass(frozen=True, slots=True)
class SettingRatios:
    """The comparisons the benchmark answers; ``None`` where a setting did not run or its
    figure is zero."""

    ttft_p50_vtoken_over_serve_default: float | None
    goodput_vtoken_over_serve_prefix_cache_affinity: float | None
    goodput_prefix_caching_on_over_off: float | None


def trial_row(trial: Trial, ideal: list[int], slo: Slo, turns: int) -> TrialRow:
    outcomes = sorted(trial.outcomes, key=lambda o: o.sent_s)
    ttfts = [o.ttft_s for o in outcomes]
    tpots = [o.tpot_s for o in outcomes if o.tpot_s is not None]
    met = [slo.meets(o.ttft_s, o.tpot_s, o.prompt_tokens) for o in outcomes]
    total = len(outcomes) + len(trial.errors)
    attainment = sum(met) / total if total else 0.0
    cached = sum(o.cached_tokens for o in outcomes)
    prompt = sum(o.prompt_tokens for o in outcomes)
    return TrialRow(
        conversation_rate=trial.rate,
        request_rate=round(trial.rate * turns, 4),
        requests=total,
        errors=trial.errors,
        slo_attainment=round(attainment, 4),
        passed=attainment >= SLO_ATTAINMENT,
        hit_rate=ratio(cached, prompt, 4),
        hit_rate_of_ideal=ratio(cached, sum(ideal), 4),
        cached_tokens=cached,
        ideal_cached_tokens=sum(ideal),
        prompt_tokens=prompt,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p99_s=percentile(ttfts, 0.99),
        tpot_p50_s=percentile(tpots, 0.5),
        wall_s=round(trial.wall_s, 2),
    )


def setting_row(setting: Setting, trials: list[TrialRow]) -> SettingRow:
    """One row per setting: goodput over the sweep, hit rates over every trial, latencies
    at its lowest rate (each trial's are in ``per_rate``)."""
    passed = []  # the rates up to the first that failed (attainment is noisy: no skipping)
    for trial in trials:
        if not trial.passed:
            break
        passed.append(trial.request_rate)
    first = trials[0]
    cached = sum(t.cached_tokens for t in trials)
    ideal = sum(t.ideal_cached_tokens for t in trials)
    prompt = sum(t.prompt_tokens for t in trials)
    return SettingRow(
        router=setting.router,
        prefix_caching=setting.prefix_caching,
        pin_cache_hits=setting.pin_cache_hits,
        setting=setting.name,
        goodput_rps=max(passed) if passed else 0.0,
        goodput_bound=(
            "at_least" if len(passed) == len(trials) else "sweep" if passed else "below_lowest"
        ),
        hit_rate=ratio(cached, prompt, 4),
        hit_rate_of_ideal=ratio(cached, ideal, 4),
        ttft_p50_s=first.ttft_p50_s,
        ttft_p99_s=first.ttft_p99_s,
        tpot_p50_s=first.tpot_p50_s,
        per_rate=trials,
    )


def ratios(rows: list[SettingRow]) -> SettingRatios:
    by = {row.setting: row for row in rows}

    def over(a: str, b: str, name: str) -> float | None:
        if a not in by or b not in by:
            return None
        return ratio(getattr(by[a], name), getattr(by[b], name), 3)

    return SettingRatios(
        ttft_p50_vtoken_over_serve_default=over("vtoken:on", "serve_default:on", "ttft_p50_s"),
        goodput_vtoken_over_serve_prefix_cache_affinity=over(
            "vtoken:on", "serve_prefix_cache_affinity:on", "goodput_rps"
        ),
        goodput_prefix_caching_on_over_off=over("vtoken:on", "vtoken:off", "goodput_rps"),
    )


def plot(rows: list[SettingRow], path: Path) -> None:
    plt = pyplot()
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    names = [row.setting for row in rows]
    hits.barh(names, [row.hit_rate_of_ideal or 0.0 for row in rows])
    hits.set_xlabel("prefix-cache hit rate (of the ideal)")
    hits.set_xlim(0, 1)
    for row in rows:
        rates = [t.request_rate for t in row.per_rate]
        ttft.plot(rates, [t.ttft_p50_s for t in row.per_rate], marker="o", label=row.setting)
    ttft.set_xlabel("request rate (req/s)")
    ttft.set_ylabel("TTFT p50 (s)")
    ttft.legend(fontsize=7)
    save_figure(figure, path)


# ---------------------------------------------------------------- what to pin
@dataclass(frozen=True, slots=True)
class PinCheckEngine:
    """One engine of the pin check: its name in the JSON, its vToken section (``None``:
    vanilla vLLM) and the prompt tokens it pins (``None``: vanilla)."""

    name: str
    vtoken: dict[str, Any] | None
    prefix_pin_tokens: int | None


def pin_check_engines(system_tokens: int) -> tuple[PinCheckEngine, ...]:
    """Vanilla vLLM, H2O at keep 0.5 evicting eagerly, and StreamingLLM (4 sinks, 256
    recent), each with the system prompt pinned and with nothing pinned; H2O also with
    cache hits pinned."""
    h2o = {"policy": "h2o", "keep_ratio": 0.5, "eviction": "eager"}
    window = {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 256}}
    pinned, hits = {"prefix_pin_tokens": system_tokens}, {"pin_cache_hits": True}
    return (
        PinCheckEngine("vanilla", None, None),
        PinCheckEngine("h2o_system_prompt_pinned", {**h2o, **pinned}, system_tokens),
        PinCheckEngine("h2o_nothing_pinned", {**h2o, "prefix_pin_tokens": 0}, 0),
        PinCheckEngine(
            "h2o_system_prompt_and_cache_hits_pinned", {**h2o, **pinned, **hits}, system_tokens
        ),
        PinCheckEngine("streaming_system_prompt_pinned", {**window, **pinned}, system_tokens),
        PinCheckEngine("streaming_nothing_pinned", {**window, "prefix_pin_tokens": 0}, 0),
    )


@dataclass(frozen=True, slots=True)
class PinCheckRow:
    engine: str
    prefix_pin_tokens: int | None
    requests: int
    hit_rate: float
    hit_rate_of_ideal: float | None
    cached_tokens: int
    ideal_cached_tokens: int
    evicted_tokens: int


def pin_check(
    tokenizer: Any, workload: list[Conversation], max_tokens: int, system_tokens: int
) -> list[PinCheckRow]:
    """The conversations turn by turn (each turn of every conversation as one batch) on one
    in-process engine with prefix caching on, per-tenant salts: vanilla vLLM, then H2O at
    keep 0.5 evicting eagerly, and StreamingLLM (4 sinks, 256 recent: it drops the middle
    of every prompt), each with the system prompt pinned and with nothing pinned."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from controlplane.prefix import cache_salt
    from workers.engine import engine_state, make_llm
    from workers.models import resolve_model

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    turns = len(workload[0].user_turns)
    rows = []
    for engine in pin_check_engines(system_tokens):
        llm = make_llm(
            str(resolve_model("smollm2")),
            engine.vtoken,
            block_size=BLOCK_SIZE,
            max_model_len=2048,
            enable_prefix_caching=True,
        )
        histories: list[list[tuple[str, str]]] = [[] for _ in workload]
        outcomes: list[Outcome] = []
        for turn in range(turns):
            prompts = [
                turn_prompt(c.system, histories[i], c.user_turns[turn])
                for i, c in enumerate(workload)
            ]
            ids = [list(tokenizer(p)["input_ids"]) for p in prompts]
            batch = [
                TokensPrompt(prompt_token_ids=i, cache_salt=cache_salt(c.tenant))
                for i, c in zip(ids, workload, strict=True)
            ]
            for index, output in enumerate(llm.generate(batch, params, use_tqdm=False)):
                answer = output.outputs[0]
                outcomes.append(
                    Outcome(
                        tenant=workload[index].tenant,
                        prompt=prompts[index],
                        ttft_s=0.0,
                        tpot_s=None,
                        prompt_tokens=len(ids[index]),
                        cached_tokens=int(output.num_cached_tokens or 0),
                        completion_tokens=len(answer.token_ids),
                        sent_s=turn * len(workload) + index,
                        text=answer.text,
                    )
                )
                histories[index].append((workload[index].user_turns[turn], answer.text))
        state = engine_state(llm)
        evicted = state.manager.num_evicted_tokens if state is not None else 0
        del llm
        ideal = ideal_cached_tokens(tokenizer, outcomes, BLOCK_SIZE)
        cached = sum(o.cached_tokens for o in outcomes)
        rows.append(
            PinCheckRow(
                engine=engine.name,
                prefix_pin_tokens=engine.prefix_pin_tokens,
                requests=len(outcomes),
                hit_rate=round(cached / sum(o.prompt_tokens for o in outcomes), 4),
                hit_rate_of_ideal=ratio(cached, sum(ideal), 4),
                cached_tokens=cached,
                ideal_cached_tokens=sum(ideal),
                evicted_tokens=evicted,
            )
        )
    return rows


# ---------------------------------------------------------------- command
@dataclass(frozen=True, slots=True)
class ProbedSlo:
    """The unloaded p50s and the SLOs set from them (rounded: requests are judged against
    these rounded bounds), as the JSON's ``slo``."""

    unloaded_ttft_p50_s: float
    unloaded_tpot_p50_s: float
    ttft_s: float
    tpot_s: float

    @property
    def slo(self) -> Slo:
        """The same bounds for every prompt length."""
        return Slo(self.ttft_s, 0.0, self.tpot_s)


def unloaded_slo(base_url: str, key: str, tenant: str, tokenizer: Any, system_tokens: int,
                 user_tokens: int, max_tokens: int) -> ProbedSlo:  # fmt: skip
    """TTFT and TPOT p50 of ``UNLOADED_PROBES`` requests one at a time, with prompts the
    workload never sends (held-out documentation), of a first turn's length."""
    corpus = doc_tokens(tokenizer, held_out=True)
    length = system_tokens + user_tokens
    outcomes: list[Outcome] = []

    async def probe() -> None:
        import httpx

        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            for index in range(UNLOADED_PROBES):
                prompt = str(tokenizer.decode(corpus[index * length : (index + 1) * length]))
                outcomes.append(await stream_completion(client, key, prompt, max_tokens, tenant))

    asyncio.run(probe())
    ttft = percentile([o.ttft_s for o in outcomes], 0.5) or 0.0
    tpot = percentile([o.tpot_s for o in outcomes if o.tpot_s is not None], 0.5) or 0.0
    return ProbedSlo(
        unloaded_ttft_p50_s=ttft,
        unloaded_tpot_p50_s=tpot,
        ttft_s=round(TTFT_SLO_FACTOR * ttft, 4),
        tpot_s=round(TPOT_SLO_FACTOR * tpot, 4),
    )


def cli(
    settings: Annotated[
        str, typer.Option(help="Comma-separated router:on|off[:pinhits].")
    ] = ",".join(SETTINGS),
    replicas: Annotated[int, typer.Option(min=1)] = 2,
    tenants: Annotated[int, typer.Option(min=1)] = 4,
    conversations: Annotated[int, typer.Option(min=1, help="Per tenant and trial.")] = 2,
    turns: Annotated[int, typer.Option(min=1)] = 4,
    system_tokens: Annotated[int, typer.Option(min=BLOCK_SIZE)] = 512,
    user_tokens: Annotated[int, typer.Option(min=1)] = 48,
    max_tokens: Annotated[int, typer.Option(min=2)] = 16,
    rates: Annotated[str, typer.Option(help="Conversation arrival rates (per s).")] = "0.25,0.5",
    seed: int = 0,
    pin_check_run: Annotated[
        bool, typer.Option("--pin-check/--no-pin-check", help="Also measure what to pin.")
    ] = True,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write the plot here.")] = None,
) -> None:
    """Prefix-cache hits, TTFT and goodput per router, prefix caching on and off."""
    from transformers import AutoTokenizer

    from serving.demo import local_cluster
    from workers.models import resolve_model

    chosen = [Setting.parse(text) for text in csv_items(settings)]
    try:
        rate_values = sorted(float(r) for r in csv_items(rates))
    except ValueError:
        raise typer.BadParameter(f"--rates takes numbers, got {rates!r}") from None
    if not rate_values or min(rate_values) <= 0:
        raise typer.BadParameter("--rates must be positive")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    names = [f"tenant-{t}" for t in range(tenants)]
    slo: ProbedSlo | None = None
    rows = []
    for setting in chosen:
        engine = {
            "enable_prefix_caching": setting.prefix_caching,
            "block_size": BLOCK_SIZE,
            "max_model_len": 2048,
        }
        app_args = {"router": setting.router}
        trials = []
        seen: dict[str, list[list[int]]] = {}  # every prompt these engines were sent
        with local_cluster(
            replicas,
            vtoken_config(system_tokens, setting.pin_cache_hits),
            engine=engine,
            app_args=app_args,
        ) as c:
            keys = asyncio.run(create_tenants(c.url, [*names, "probe"]))
            if slo is None:
                slo = unloaded_slo(
                    c.url, keys["probe"], "probe", tokenizer, system_tokens, user_tokens, max_tokens
                )
                typer.echo(f"SLO: {asdict(slo)}")
            for index, rate in enumerate(rate_values):
                workload = make_workload(
                    tokenizer, tenants, conversations, turns, system_tokens, user_tokens, rate,
                    seed + index,
                )  # fmt: skip
                trial = Trial(setting.name, rate)
                asyncio.run(run_trial(c.url, keys, workload, max_tokens, trial))
                ideal = ideal_cached_tokens(tokenizer, trial.outcomes, BLOCK_SIZE, seen)
                row = trial_row(trial, ideal, slo.slo, turns)
                typer.echo(f"{setting.name} @ {rate}/s: {json.dumps(asdict(row))}")
                trials.append(row)
                # The next rate: a new seed, new user messages, the same system prompts
                # (still cached, as a serving system's would be: ``seen`` counts them).
        rows.append(setting_row(setting, trials))
    document = {
        "replicas": replicas,
        "tenants": tenants,
        "conversations_per_tenant": conversations,
        "turns": turns,
        "system_tokens": system_tokens,
        "user_tokens": user_tokens,
        "max_tokens": max_tokens,
        "think_s": THINK_S,
        "block_size": BLOCK_SIZE,
        "seed": seed,
        "vtoken": vtoken_config(system_tokens),
        "slo": None if slo is None else asdict(slo),
        "routers": [asdict(row) for row in rows],
        "ratios": asdict(ratios(rows)),
    }
    if pin_check_run:  # one conversation per tenant: nothing else shares its system prompt
        workload = make_workload(
            tokenizer, tenants, 1, turns, system_tokens, user_tokens, 1.0, seed
        )
        rows_pinned = pin_check(tokenizer, workload, max_tokens, system_tokens)
        document["pin_check"] = [asdict(row) for row in rows_pinned]
    typer.echo(json.dumps({k: v for k, v in document.items() if k != "routers"}, indent=2))
    if json_path is not None:
        write_json(json_path, document)
    if plot_path is not None:
        plot(rows, plot_path)
