"""What the scheduler side keeps of one running request, its ops outbox, and what it reads
of vLLM's requests."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vtoken.groups import GroupedMoves, ModelGeometry
from vtoken.manager import RequestKV
from vtoken.policy import ScoreNeeds
from vtoken.reports import RequestReport
from workers.config import HOLD_TO_BLOCKS_KEY, PolicySpec
from workers.messages import StepOps

EMPTY_SLOTS = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class ScheduledRequest:
    """One running request of the engine core: the manager's entry (its pinned prefix is
    ``kv.num_pinned``), its policy spec, what the workers still have to apply (repack
    moves, the block count after the repack or, in block mode, the block list after a
    drop), and every step's evicted logical ids when
    ``record_evictions`` is on."""

    kv: RequestKV
    spec: PolicySpec
    capped: bool = False  # its spec is a per-request override (the tenant's cap)
    cacheable: int | None = None  # tokens it may publish; None: every full block
    shared_elsewhere: int = 0  # blocks it holds that another request pays for (this step)
    copy_deferred: bool = False  # no free block to copy its shared blocks into this step
    copied: dict[int, int] = field(default_factory=dict)  # this step's copies: index -> shared
    hit_tokens: int = 0  # tokens it took from a prefix-cache hit
    hold_blocks: int | None = None  # what admission counts it at once its prefill ended
    pressure_anchor: int | None = None  # live tokens when its tenant's pressure reached it
    pending_src: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    pending_dst: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    pending_grouped: GroupedMoves = field(default_factory=GroupedMoves.empty)  # per group
    pending_num_blocks: int | None = None
    pending_block_row: np.ndarray | None = None  # block mode: its whole new block list
    evictions: list[np.ndarray] = field(default_factory=list)
    scored: bool = True  # its policy gets what it needs to evict after the step scheduled last

    @property
    def paid_blocks(self) -> int:
        """Blocks it holds (ballast included) less those another request pays for."""
        return self.kv.num_held_blocks - self.shared_elsewhere

    def queue_moves(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        group_ids: np.ndarray | None,
        geometry: ModelGeometry | None,
    ) -> None:
        """Add a committed repack's KV moves to what the workers apply next step: whole
        slots, or (``group_ids``: a set per layer or head) each group's on its own map."""
        if group_ids is not None:
            assert geometry is not None, "a grouped table in an engine without geometry"
            shape = self.kv.table.group_shape
            moves = GroupedMoves.of_groups(group_ids, src, dst, shape, geometry.num_kv_heads)
            self.pending_grouped = GroupedMoves.concatenate([self.pending_grouped, moves])
        elif src.size:
            self.pending_src = np.concatenate([self.pending_src, src])
            self.pending_dst = np.concatenate([self.pending_dst, dst])

    def check_invariants(self, vllm_block_ids: list[int], naive: bool) -> None:
        """Its table holds vLLM's block list (``vllm_block_ids``), repacked, with exactly
        Naive-Evict's ballast in naive mode (none otherwise), and never the null block."""
        kv, request_id = self.kv, self.kv.request_id
        assert vllm_block_ids == kv.table.block_ids, f"{request_id}: vLLM blocks != token table"
        assert kv.table.num_slots == kv.table.num_live, f"{request_id}: not repacked"
        assert len(kv.table.block_ids) == kv.table.num_ideal_blocks
        ballast = kv.table.num_naive_blocks() - len(kv.table.block_ids) if naive else 0
        assert len(kv.ballast) == ballast, f"{request_id}: ballast is not Naive-Evict's"
        assert 0 not in kv.table.block_ids + kv.ballast, "the null block was handed out"


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A finished request's last report and (``record_evictions``) its evictions."""

    report: RequestReport
    evictions: list[np.ndarray]


def hold_blocks_of(extra: Mapping[str, Any]) -> int | None:
    """The request's ``HOLD_TO_BLOCKS_KEY`` (a positive int), else ``None``."""
    value = extra.get(HOLD_TO_BLOCKS_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def ends_with_this_step(request: Any) -> bool:
    """Whether a decoding vLLM ``Request`` reaches its ``max_tokens`` with the token this
    step samples (vLLM's stop check runs after the vToken step hook). Stop tokens and
    strings are not foreseen: such a request counts as going on."""
    max_tokens = getattr(request, "max_tokens", None)
    num_output = getattr(request, "num_output_tokens", None)
    if not isinstance(max_tokens, int) or not isinstance(num_output, int):
        return False
    if getattr(request, "resumable", False):
        return False  # a streaming-input request keeps its blocks for its next input
    decoding = request.num_computed_tokens >= request.num_tokens
    return decoding and num_output + 1 >= max_tokens


def take_ops(
    records: Mapping[str, ScheduledRequest],
    num_scheduled_tokens: Mapping[str, int],
    requests: Mapping[str, Any],
    may_evict: Collection[str],
) -> StepOps:
    """The ops the workers apply before this step's forward (see ``StepOps``): each
    scheduled request's evicted count and score needs (all its policy declares if it is in
    ``may_evict``, else what it observes every step), and every pending repack (taken:
    the records keep none afterwards)."""
    num_evicted, score_needs = {}, {}
    for request_id in num_scheduled_tokens:
        record = records.get(request_id)
        if record is None:
            continue
        table, policy = record.kv.table, record.kv.policy
        assert table.num_logical == requests[request_id].num_computed_tokens
        num_evicted[request_id] = table.num_logical - table.num_slots
        needs = full = ScoreNeeds()
        if policy is not None:
            needs, full = policy.needs_at_step(request_id in may_evict), policy.score_needs()
        record.scored = needs == full
        if needs.any:
            score_needs[request_id] = needs
    src, dst, num_blocks, block_rows = [EMPTY_SLOTS], [EMPTY_SLOTS], {}, {}
    grouped: list[GroupedMoves] = []
    for request_id, record in records.items():
        if record.pending_block_row is not None:
            block_rows[request_id] = record.pending_block_row
            record.pending_block_row = None
        if record.pending_num_blocks is not None:
            src.append(record.pending_src)
            dst.append(record.pending_dst)
            grouped.append(record.pending_grouped)
            num_blocks[request_id] = record.pending_num_blocks
            record.pending_src = record.pending_dst = EMPTY_SLOTS
            record.pending_grouped = GroupedMoves.empty()
            record.pending_num_blocks = None
    return StepOps(
        src_slots=np.concatenate(src),
        dst_slots=np.concatenate(dst),
        num_blocks=num_blocks,
        block_rows=block_rows,
        num_evicted=num_evicted,
        score_needs=score_needs,
        grouped=GroupedMoves.concatenate(grouped),
    )


def find_report(
    request_id: str,
    running: Mapping[str, Any],
    finished: Mapping[str, FinishedRequest],
    report_of: Callable[[str], RequestReport],
) -> RequestReport | None:
    """One request's report: running (``report_of``), or among the recently finished.

    ``request_id`` may be the client's id: vLLM's front end appends ``-<8 chars>`` to it
    for the engine core, so the most recent request with that prefix is returned.
    """

    def matches(engine_id: str) -> bool:
        return engine_id == request_id or engine_id.rpartition("-")[0] == request_id

    for engine_id in reversed(list(running)):
        if matches(engine_id):
            return report_of(engine_id)
    for engine_id in reversed(list(finished)):
        if matches(engine_id):
            return finished[engine_id].report
    return None
