"""`vtoken bench faults`: the real stack under faults, every request counted.

The command starts everything itself: a persistent ``redis-server`` (append-only file),
a private local Ray cluster, and the Serve app (2 vLLM CPU engine replicas running vToken +
H2O, the ingress, the controller). The engines run a tiny random Llama (2 layers, hidden
128) with SmolLM2's tokenizer by default, so a replica restarts in seconds; ``--model
smollm2`` runs the real model.

Each scenario runs against a steady load of ``--concurrency`` clients (default 16), half
of their requests streamed, two tenants whose budgets never bind. A client answered 429
waits its Retry-After and tries the same request again (one request, not a new one); any
other answer ends the request, which is counted:

- ``ok``: a complete JSON answer, or a stream that reached ``[DONE]`` without an error;
- ``failed``: everything else except the client's own aborts. Among them,
  ``failed_with_error_event`` (a stream that ended with an SSE error event, then
  ``[DONE]``), ``silent_cuts`` (a stream or body that ended with neither ``[DONE]`` nor an
  error), ``failed_503_retry_after`` (a JSON 503 carrying Retry-After);
- ``aborted``: streams the client itself hung up on (``client_disconnect`` only).

Scenarios (the fault is injected ``PRE_FAULT_S`` after the load starts):

- ``replica_kill``: SIGKILL the process of the engine replica running the most requests
  (its PID from Ray's actor table); ``in_flight_on_killed`` is what that replica reported
  running just before; ``replica_back_s`` is how long until two fresh replicas report.
- ``controller_kill``: SIGKILL the controller's replica; ``controller_back_s`` is how long
  until a new plan is written.
- ``redis_restart``: stop Redis (SIGTERM, which flushes its append-only file), keep it down
  ``--outage-s`` (10 s), start it again on the same port from that file.
- ``redis_oom``: ``maxmemory`` set to Redis's used memory + 1 KiB with ``noeviction`` for
  ``--outage-s``, then restored.
- ``client_disconnect``: one streaming request in three hangs up after its first two events.
- ``clock_skew``: a second ingress, built in this process around the same replicas and
  Redis with a clock 10 minutes ahead, takes half of the clients. The Serve ingress runs
  in a Ray actor whose clock cannot be moved without touching the host's; admission,
  renewal and lapsing all run on Redis's ``TIME``, so the ingress clock feeds only the
  ``created`` field and latency figures. ``max_deadline_ahead_s`` (how far the furthest
  reservation deadline lies past Redis's now, sampled during the load) must stay within
  the reservation TTL.

After a scenario the load stops and drains; then ``leaked_reservations`` (reservations
still in Redis, per tenant, after up to ``DRAIN_TIMEOUT_S``) and ``leaked_blocks`` (KV
blocks still used per fresh replica above its idle level, from ``/admin/status``).
``recovery_s``: from the fault to the first success of a request sent after the
scenario's last failure (after the fault itself when nothing failed). ``engine_restarts``:
engine replica actors created during the scenario (Ray's actor table).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import write_json

SCENARIOS = (
    "replica_kill",
    "controller_kill",
    "redis_restart",
    "redis_oom",
    "client_disconnect",
    "clock_skew",
)
MODEL_NAME = "faults"
PRE_FAULT_S = 4.0
POST_FAULT_S = 10.0  # load after the fault (after recovery, where one is awaited)
DRAIN_TIMEOUT_S = 20.0
CLOCK_SKEW_S = 600.0
RESERVATION_TTL_S = 600.0  # AdmissionConfig's default: what a skewed deadline is held to
MAX_RETRY_WAIT_S = 5.0


class Outcome(enum.Enum):
    OK = "ok"
    ABORTED = "aborted"  # the client hung up on purpose
    ERROR_EVENT = "error_event"  # 200 stream that ended with an SSE error event
    SILENT_CUT = "silent_cut"  # ended with neither [DONE] nor an error
    UNAVAILABLE = "unavailable"  # 503 with Retry-After and an OpenAI error body
    FAILED = "failed"  # any other error answer, or no answer at all
    THROTTLED = "throttled"  # 429: the client retries the same request


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant of the load; its budget never binds."""

    id: str
    budget_blocks: int


TENANTS = (Tenant("steady-a", 400), Tenant("steady-b", 400))
FAILURES = (Outcome.ERROR_EVENT, Outcome.SILENT_CUT, Outcome.UNAVAILABLE, Outcome.FAILED)


@dataclass(frozen=True, slots=True)
class Record:
    """One request: when it was sent and ended (seconds on the load's clock), how."""

    started: float
    ended: float
    outcome: Outcome
    stream: bool
    detail: str = ""


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def classify(status: int, stream: bool, text: str, headers: dict[str, str]) -> Outcome:
    """How an answer that arrived in full (``text``: the body) ended."""
    if status == 429:
        return Outcome.THROTTLED
    if status == 200 and stream:
        events = sse_events(text)
        for event in events:
            if event != "[DONE]" and "error" in _json_or_empty(event):
                return Outcome.ERROR_EVENT
        return Outcome.OK if events and events[-1] == "[DONE]" else Outcome.SILENT_CUT
    body = _json_or_empty(text)
    if status == 200:
        choices = body.get("choices") or [{}]
        return Outcome.OK if choices[0].get("finish_reason") else Outcome.SILENT_CUT
    lowered = {k.lower(): v for k, v in headers.items()}
    if status == 503 and "retry-after" in lowered and "error" in body:
        return Outcome.UNAVAILABLE
    return Outcome.FAILED


def _json_or_empty(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def recovery_s(records: list[Record], fault_at: float | None) -> float | None:
    """From the fault to the first success of a request sent after the last failure that
    ended after the fault (after the fault itself when none failed); None: no success."""
    if fault_at is None:
        return None
    failures = [r.ended for r in records if r.outcome in FAILURES and r.ended >= fault_at]
    since = max(failures, default=fault_at)
    successes = [r.ended for r in records if r.outcome is Outcome.OK and r.started >= since]
    return round(min(successes) - fault_at, 2) if successes else None


@dataclass(frozen=True, slots=True)
class Counts:
    """The counting part of a scenario's row (the module docstring defines each)."""

    scenario: str
    requests: int
    ok: int
    failed: int
    failed_with_error_event: int
    silent_cuts: int
    failed_503_retry_after: int
    failed_other: int
    aborted: int
    throttled_at_stop: int
    recovery_s: float | None


@dataclass(frozen=True, slots=True)
class Leaks:
    """What a drained scenario left behind; ``None`` (a missed target) where Redis or the
    status could not be read."""

    leaked_reservations: int | None
    leaked_reservations_by_tenant: dict[str, int]
    leaked_blocks: int | None
    leaked_blocks_by_replica: dict[str, int]


def summarize(scenario: str, records: list[Record], fault_at: float | None) -> Counts:
    """The counting part of a scenario's row (the rest is measured on the stack)."""
    outcomes = Counter(r.outcome for r in records)
    counts = Counts(
        scenario=scenario,
        requests=len(records),
        ok=outcomes[Outcome.OK],
        failed=sum(outcomes[o] for o in FAILURES),
        failed_with_error_event=outcomes[Outcome.ERROR_EVENT],
        silent_cuts=outcomes[Outcome.SILENT_CUT],
        failed_503_retry_after=outcomes[Outcome.UNAVAILABLE],
        failed_other=outcomes[Outcome.FAILED],
        aborted=outcomes[Outcome.ABORTED],
        throttled_at_stop=outcomes[Outcome.THROTTLED],
        recovery_s=recovery_s(records, fault_at),
    )
    assert counts.ok + counts.failed + counts.aborted + counts.throttled_at_stop == len(records)
    return counts


def targets_met(row: dict[str, Any]) -> bool:
    """The issue's targets for one scenario's row (``Counts``, ``Leaks``, engine restarts
    and the scenario's own figures, flattened)."""
    leaks = row["leaked_reservations"] == 0 and row["leaked_blocks"] == 0
    base = leaks and row["silent_cuts"] == 0
    scenario = row["scenario"]
    if scenario == "replica_kill":
        recovered = row["recovery_s"] is not None and row["recovery_s"] <= 30
        return base and row["failed"] <= row.get("in_flight_on_killed", 0) and recovered
    if scenario in ("redis_restart", "redis_oom"):
        only_503s = row["failed"] == row["failed_503_retry_after"]
        return base and only_503s and row["engine_restarts"] == 0
    return base and row["failed"] == 0


# ---------------------------------------------------------------------- the load
@dataclass
class Load:
    """``concurrency`` clients sending requests until ``stop`` is set."""

    urls: list[str]
    keys: list[str]
    max_tokens: tuple[int, int]
    disconnect_every: int = 0  # every n-th streaming request hangs up early (0: never)
    started: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    in_flight: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.monotonic() - self.started

    async def client(self, index: int, http: Any) -> None:
        import httpx

        rng = random.Random(index)
        count = 0
        while not self.stop.is_set():
            count += 1
            stream = count % 2 == index % 2
            url = self.urls[index % len(self.urls)]
            key = self.keys[(index // len(self.urls)) % len(self.keys)]
            body = {
                "model": MODEL_NAME,
                "prompt": prompt_text(rng),
                "max_tokens": rng.randint(*self.max_tokens),
                "temperature": 0.0,
                "stream": stream,
            }
            abort = stream and self.disconnect_every > 0 and count % self.disconnect_every == 0
            started = self.now()
            self.in_flight += 1
            try:
                outcome, detail = await self.one(http, url, key, body, abort)
            except httpx.HTTPError as error:
                outcome, detail = Outcome.FAILED, f"{type(error).__name__}: {error}"[:200]
            finally:
                self.in_flight -= 1
            self.records.append(Record(started, self.now(), outcome, stream, detail))

    async def one(
        self, http: Any, url: str, key: str, body: dict[str, Any], abort: bool
    ) -> tuple[Outcome, str]:
        import httpx

        headers = {"Authorization": f"Bearer {key}"}
        while True:
            if not body["stream"]:
                response = await http.post(f"{url}/v1/completions", json=body, headers=headers)
                status, text = response.status_code, response.text
            else:
                lines: list[str] = []
                async with http.stream(
                    "POST", f"{url}/v1/completions", json=body, headers=headers
                ) as response:
                    status = response.status_code
                    try:
                        async for line in response.aiter_lines():
                            lines.append(line)
                            if abort and status == 200 and len(sse_events("\n".join(lines))) >= 2:
                                return Outcome.ABORTED, ""  # leaving the block hangs up
                    except httpx.HTTPError as error:
                        return Outcome.SILENT_CUT, f"{type(error).__name__}"  # cut mid-stream
                text = "\n".join(lines)
            outcome = classify(status, body["stream"], text, dict(response.headers))
            if outcome is not Outcome.THROTTLED:
                return outcome, "" if outcome is Outcome.OK else f"{status}: {text[-200:]}"
            if self.stop.is_set():
                return outcome, "429 when the load stopped"
            wait_s = float(response.headers.get("Retry-After", "1"))
            await asyncio.sleep(min(wait_s, MAX_RETRY_WAIT_S))


def prompt_text(rng: random.Random) -> str:
    sentence = "The for statement iterates over the items of a sequence in order."
    return " ".join([sentence] * rng.randint(2, 5))


# ---------------------------------------------------------------------- the stack
@contextlib.contextmanager
def local_stack(model: str, folder: Path, app_args: dict[str, Any] | None = None) -> Iterator[Any]:
    """Redis (append-only), a private local Ray cluster and the Serve app: 2 replicas of
    ``model`` (``smollm2`` or ``tiny``) with vToken + H2O keep 0.5 (``app_args``: more
    ``AppArgs`` fields); yields the ``serving.demo.LocalCluster``."""
    from serving.demo import local_cluster
    from workers.models import make_tiny_llama, resolve_model

    smollm2 = resolve_model("smollm2")
    path = smollm2 if model == "smollm2" else make_tiny_llama(folder / "tiny", smollm2)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with local_cluster(
        2,
        {"policy": "h2o", "keep_ratio": 0.5},
        engine={
            "model": str(path),
            "served_name": MODEL_NAME,
            "max_model_len": 512,
            "num_blocks": 160,
        },
        app_args={"replica_num_cpus": 1, "controller_period_s": 0.5, **(app_args or {})},
        ray_init={"num_cpus": 4, "runtime_env": {"env_vars": env}},
        folder=folder,
    ) as cluster:
        yield cluster


def serve_actors(role: str) -> list[dict[str, Any]]:
    """Ray's actor table rows (any state) of the app's ``role`` replicas (engine,
    controller). The table comes from the GCS: ``ray.util.state`` would need the
    dashboard, which this private cluster does not start."""
    from ray._private import state

    return [
        row
        for row in state.actors().values()
        if row["Name"].startswith("SERVE_REPLICA::") and f"#{role}#" in row["Name"]
    ]


def alive_actor(role: str, replica_id: str | None = None) -> dict[str, Any]:
    rows = [r for r in serve_actors(role) if r["State"] == "ALIVE"]
    if replica_id is not None:
        rows = [r for r in rows if r["Name"].endswith(f"#{replica_id}")]
    if not rows:
        raise RuntimeError(f"no live {role} replica {replica_id or ''}")
    return rows[0]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: vLLM's engine core and its workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class SkewedClock:
    """The system clock ``offset_s`` ahead."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def now(self) -> float:
        return time.time() + self.offset_s

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@contextlib.asynccontextmanager
async def skewed_ingress(stack: Any, offset_s: float) -> AsyncIterator[str]:
    """A second ingress in this process (same replicas, same Redis, same model) whose
    clock is ``offset_s`` ahead; yields its base URL."""
    import uvicorn
    from ray import serve
    from transformers import AutoTokenizer

    from controlplane import telemetry
    from controlplane.admission import AdmissionConfig
    from controlplane.local_redis import free_port
    from controlplane.redis_conn import RedisConfig, connect
    from serving.ingress import build_api
    from serving.openai_http import IngressState
    from serving.settings import IngressSettings

    settings = IngressSettings(
        model_name=MODEL_NAME,
        tokenizer_path=stack.model_path,
        max_model_len=512,
        admin_token=stack.admin_token,
        redis_url=stack.redis.url,
        admission=AdmissionConfig(block_size=32, keep_ratio=0.5),
    )
    redis = connect(RedisConfig(url=stack.redis.url))
    state = IngressState(
        settings,
        serve.get_deployment_handle("engine", app_name="vtoken"),
        redis=redis,
        clock=SkewedClock(offset_s),
        tokenizer=AutoTokenizer.from_pretrained(stack.model_path),
        tracer=telemetry.NOOP_TRACER,
    )
    port = free_port()
    config = uvicorn.Config(build_api(state), host="127.0.0.1", port=port, log_level="error")
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        await redis.aclose()


# ---------------------------------------------------------------------- scenarios
class Bench:
    def __init__(self, stack: Any, concurrency: int, outage_s: float, max_tokens: tuple):
        import redis

        self.stack = stack
        self.redis: Any
        self.concurrency = concurrency
        self.outage_s = outage_s
        self.max_tokens = max_tokens
        self.keys: list[str] = []
        self.idle_blocks_used: int | None = None
        self.redis = redis.Redis.from_url(stack.redis.url)

    async def status(self, http: Any) -> dict[str, Any] | None:
        try:
            response = await http.get(f"{self.stack.url}/admin/status", headers=self.stack.admin)
        except Exception:  # noqa: BLE001 - a status probe that fails is just no sample
            return None
        return response.json() if response.status_code == 200 else None

    async def fresh_replicas(self, http: Any) -> list[dict[str, Any]]:
        status = await self.status(http)
        return [r for r in (status or {}).get("replicas", []) if r.get("fresh")]

    async def wait_until(self, probe: Callable[[], Any], timeout_s: float) -> float | None:
        """Seconds until ``await probe()`` is truthy; None at the timeout."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if await probe():
                return time.monotonic() - started
            await asyncio.sleep(0.1)
        return None

    async def setup(self, http: Any) -> None:
        for tenant in TENANTS:
            response = await http.put(
                f"{self.stack.url}/admin/tenants/{tenant.id}",
                # No fair queue: a throttle is a 429 at once, as in the runs before it.
                json={"kv_budget_blocks": tenant.budget_blocks, "max_queue_depth": 0},
                headers=self.stack.admin,
            )
            response.raise_for_status()
            self.keys.append(response.json()["api_key"])
        await self.ready(http, timeout_s=120)
        replicas = await self.fresh_replicas(http)
        self.idle_blocks_used = min(r["blocks_used"] for r in replicas)

    async def ready(self, http: Any, timeout_s: float) -> float | None:
        """Seconds until two fresh replicas report and a request is answered."""

        async def probe() -> bool:
            if len(await self.fresh_replicas(http)) < 2:
                return False
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
            headers = {"Authorization": f"Bearer {self.keys[0]}"}
            try:
                answer = await http.post(
                    f"{self.stack.url}/v1/completions", json=body, headers=headers
                )
            except Exception:  # noqa: BLE001
                return False
            return answer.status_code == 200

        return await self.wait_until(probe, timeout_s)

    def engine_actor_count(self) -> int:
        return len(serve_actors("engine"))

    async def run(self, scenario: str) -> dict[str, Any]:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency * 2 + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            if not self.keys:
                await self.setup(http)
            await self.ready(http, timeout_s=120)
            engines_before = self.engine_actor_count()
            extra: dict[str, Any] = {}
            async with contextlib.AsyncExitStack() as stack:
                urls = [self.stack.url]
                if scenario == "clock_skew":
                    urls.append(
                        await stack.enter_async_context(skewed_ingress(self.stack, CLOCK_SKEW_S))
                    )
                load = Load(
                    urls,
                    self.keys,
                    self.max_tokens,
                    disconnect_every=3 if scenario == "client_disconnect" else 0,
                )
                clients = [
                    asyncio.create_task(load.client(i, http)) for i in range(self.concurrency)
                ]
                await asyncio.sleep(PRE_FAULT_S)
                fault_at = load.now()
                extra = await self.inject(scenario, http, load)
                await asyncio.sleep(POST_FAULT_S)
                load.stop.set()
                await asyncio.gather(*clients)
            row = asdict(summarize(scenario, load.records, fault_at))
            row.update(asdict(await self.leaks(http)))
            row["engine_restarts"] = self.engine_actor_count() - engines_before
            row.update(extra)
            row["errors"] = sorted({r.detail for r in load.records if r.detail})[:8]
            row["targets_met"] = targets_met(row)
            return row

    async def inject(self, scenario: str, http: Any, load: Load) -> dict[str, Any]:
        """Inject the fault (and, where there is one, wait for the recovery)."""
        if scenario == "replica_kill":
            return await self.kill_replica(http)
        if scenario == "controller_kill":
            return await self.kill_controller(http)
        if scenario == "redis_restart":
            await asyncio.to_thread(self.stack.redis.stop)
            await asyncio.sleep(self.outage_s)
            await asyncio.to_thread(self.stack.redis.start)
            return {"outage_s": self.outage_s}
        if scenario == "redis_oom":
            return await self.out_of_memory()
        if scenario == "clock_skew":
            return {"clock_skew_s": CLOCK_SKEW_S, **await self.deadlines_while(load)}
        return {}  # client_disconnect: the load itself hangs up

    async def kill_replica(self, http: Any) -> dict[str, Any]:
        replicas = await self.fresh_replicas(http)
        victim = max(replicas, key=lambda r: r["running_requests"])
        actor = alive_actor("engine", victim["id"])
        pid = int(actor["Pid"])
        below = descendants(pid)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        async def two_fresh() -> bool:
            fresh = await self.fresh_replicas(http)
            return len(fresh) == 2 and victim["id"] not in {r["id"] for r in fresh}

        back_s = await self.wait_until(two_fresh, timeout_s=180)
        await asyncio.sleep(2.0)
        orphans = [p for p in below if alive(p)]
        for orphan in orphans:  # what the killed replica left running, if anything
            with contextlib.suppress(OSError):
                os.kill(orphan, signal.SIGKILL)
        return {
            "in_flight_on_killed": victim["running_requests"],
            "replica_back_s": None if back_s is None else round(back_s, 1),
            "wait_s": round(time.monotonic() - killed_at, 1),
            "orphaned_processes": len(orphans),
        }

    async def kill_controller(self, http: Any) -> dict[str, Any]:
        before = (await self.status(http) or {}).get("plan_heartbeat_s")
        actor = alive_actor("controller")
        os.kill(int(actor["Pid"]), signal.SIGKILL)
        seen = {before}

        async def new_plan() -> bool:
            heartbeat = (await self.status(http) or {}).get("plan_heartbeat_s")
            # A write from the dead controller may land just before; wait for two moves.
            seen.add(heartbeat)
            return len(seen) >= 3

        back_s = await self.wait_until(new_plan, timeout_s=120)
        return {"controller_back_s": None if back_s is None else round(back_s, 1)}

    async def out_of_memory(self) -> dict[str, Any]:
        config: dict[str, str] = await asyncio.to_thread(self.redis.config_get, "maxmemory*")
        used = int((await asyncio.to_thread(self.redis.info, "memory"))["used_memory"])
        await asyncio.to_thread(self.redis.config_set, "maxmemory-policy", "noeviction")
        await asyncio.to_thread(self.redis.config_set, "maxmemory", used + 1024)
        try:
            await asyncio.sleep(self.outage_s)
        finally:
            await asyncio.to_thread(self.redis.config_set, "maxmemory", config["maxmemory"])
            policy = config["maxmemory-policy"]
            await asyncio.to_thread(self.redis.config_set, "maxmemory-policy", policy)
        return {"outage_s": self.outage_s, "maxmemory_bytes": used + 1024}

    async def deadlines_while(self, load: Load) -> dict[str, Any]:
        """How far reservation deadlines lie past Redis's now while the load runs."""
        from controlplane.keys import KeySpace

        keys = KeySpace()
        ahead = 0.0
        for _ in range(20):
            seconds, micros = await asyncio.to_thread(self.redis.time)
            now_ms = seconds * 1000 + micros // 1000
            for tenant in TENANTS:
                key = keys.reservation_deadlines(tenant.id)
                top = await asyncio.to_thread(
                    functools.partial(self.redis.zrange, key, -1, -1, withscores=True)
                )
                if top:
                    ahead = max(ahead, (top[0][1] - now_ms) / 1000)
            await asyncio.sleep(0.25)
        return {"max_deadline_ahead_s": round(ahead, 1), "reservation_ttl_s": RESERVATION_TTL_S}

    async def leaks(self, http: Any) -> Leaks:
        """Reservations left per tenant and blocks still used per replica, once drained."""
        from controlplane.keys import KeySpace

        keys = KeySpace()

        def reservations() -> dict[str, int]:
            try:
                return {t.id: int(self.redis.hlen(keys.reservations(t.id))) for t in TENANTS}
            except Exception:  # noqa: BLE001 - Redis not back yet: count as held
                return {t.id: -1 for t in TENANTS}

        async def drained() -> bool:
            held = await asyncio.to_thread(reservations)
            replicas = await self.fresh_replicas(http)
            idle = self.idle_blocks_used or 0
            return not any(held.values()) and all(r["blocks_used"] <= idle for r in replicas)

        await self.wait_until(drained, DRAIN_TIMEOUT_S)
        held = await asyncio.to_thread(reservations)
        replicas = await self.fresh_replicas(http)
        idle = self.idle_blocks_used or 0
        blocks = {r["id"][:8]: max(0, r["blocks_used"] - idle) for r in replicas}
        return Leaks(
            leaked_reservations=None if -1 in held.values() else sum(held.values()),
            leaked_reservations_by_tenant=held,
            leaked_blocks=sum(blocks.values()) if len(replicas) >= 2 else None,
            leaked_blocks_by_replica=blocks,
        )


def run(
    scenarios: tuple[str, ...], model: str, concurrency: int, outage_s: float, max_tokens: tuple
) -> dict[str, Any]:
    started = time.monotonic()
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="vtoken-faults-") as folder,
        local_stack(model, Path(folder)) as stack,
    ):
        bench = Bench(stack, concurrency, outage_s, max_tokens)
        for scenario in scenarios:
            try:
                row = asyncio.run(bench.run(scenario))
            except Exception as error:  # noqa: BLE001 - one broken scenario must not hide the rest
                typer.echo(f"{scenario}: the scenario itself failed: {error!r}", err=True)
                rows.append({"scenario": scenario, "error": repr(error), "targets_met": False})
                continue
            typer.echo(
                f"{scenario}: {row['requests']} requests, {row['ok']} ok, "
                f"{row['failed']} failed ({row['failed_with_error_event']} error events, "
                f"{row['failed_503_retry_after']} 503s), {row['silent_cuts']} silent cuts, "
                f"leaks {row['leaked_reservations']}/{row['leaked_blocks']}, "
                f"recovery {row['recovery_s']} s, engine restarts {row['engine_restarts']}"
                f"{'' if row['targets_met'] else '  [TARGET MISSED]'}"
            )
            rows.append(row)
    return {
        "config": {
            "model": model,
            "replicas": 2,
            "concurrency": concurrency,
            "outage_s": outage_s,
            "max_tokens": list(max_tokens),
            "pre_fault_s": PRE_FAULT_S,
            "post_fault_s": POST_FAULT_S,
            "tenants": [asdict(t) for t in TENANTS],
        },
        "elapsed_s": round(time.monotonic() - started, 1),
        "scenarios": rows,
        "all_targets_met": all(r["targets_met"] for r in rows),
    }


def cli(
    json_path: Annotated[Path, typer.Option("--json", help="write the results here")],
    scenario: Annotated[
        list[str] | None, typer.Option(help="run only these (repeatable); default: all")
    ] = None,
    model: Annotated[str, typer.Option(help="'tiny' (random, fast) or 'smollm2'")] = "tiny",
    concurrency: Annotated[int, typer.Option(min=1)] = 16,
    outage_s: Annotated[float, typer.Option(min=1, help="Redis down / at maxmemory")] = 10.0,
    max_tokens: Annotated[int, typer.Option(min=2, help="longest answer")] = 96,
) -> None:
    """Faults on the real stack (killed replica / controller, Redis restart and OOM,
    client disconnects, a skewed ingress clock), every request counted."""
    chosen = tuple(scenario) if scenario else SCENARIOS
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown or model not in ("tiny", "smollm2"):
        raise typer.BadParameter(f"unknown scenario or model: {unknown or model}")
    summary = run(chosen, model, concurrency, outage_s, (max(2, max_tokens // 3), max_tokens))
    write_json(json_path, summary, indent=1)
    typer.echo(f"all targets met: {summary['all_targets_met']} ({summary['elapsed_s']} s)")
