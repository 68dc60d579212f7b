"""A runner-shaped check of the repack's ordering, without vLLM: the steps of vLLM's model
runner as vToken changes them, on a dedicated compute stream, checked every step against
attention computed on the host from the tokens each request still holds.

Per step (``run_harness``):

1. the host "scheduler" evicts some tokens of one request: the tail tokens move into the
   holes (``src -> dst`` slots), the emptied tail blocks are freed and handed, in the same
   step, to a new request whose prompt is written into them;
2. the repack is submitted to ``kernels.async_repack.SideStreamRepacker`` behind a device
   sleep on its side stream (the copies run late), then ``fence()`` orders the compute
   stream after them (the negative control skips the fence);
3. on the compute stream, behind a shorter device sleep: the block table and slot mapping
   are uploaded from pinned memory (``non_blocking``), every request's new tokens are
   written through the slot mapping (a decode token each, the new request's prompt), and
   each request's decode query attends over its physical ``seq_lens`` through the block
   table;
4. the outputs come back through pinned memory and one event, and are compared with the
   host reference: the same query over the request's live tokens, from the host's copy of
   every token written.

With the fence, every step must match (float32 attention over bf16 keys and values: max
error about 1e-6; the tolerance is 1e-3). Without it, the new request's prompt lands in
the freed blocks before the late copies read them, and attention reads holes not yet
filled: the check must fail, or it shows nothing. On CPU the repack is synchronous, so
the negative control cannot fail there; ``drop_moves`` (no repack at all) stands in as
the control that the reference comparison catches a wrong cache.

Usage on a GPU: ``python -m bench.runner_harness OUT.json`` (exit 0 when the fenced run
passes and the unfenced one fails).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from kernels import KVLayout
from kernels.async_repack import SideStreamRepacker
from kernels.layout import paged_layer_views

LAYOUT = KVLayout.BHNC
TOLERANCE = 1e-3
COMPUTE_SLEEP_CYCLES = 20_000_000  # about 10 ms of spinning before the forward
SIDE_SLEEP_CYCLES = 100_000_000  # about 50 ms before the copies: they run after the forward


@dataclass(frozen=True, slots=True)
class HarnessShape:
    num_blocks: int = 96
    block_size: int = 16
    num_kv_heads: int = 2
    num_q_heads: int = 8
    head_dim: int = 64
    num_steps: int = 12
    first_prompts: tuple[int, ...] = (150, 97, 64)
    new_prompt: int = 20  # tokens of the request started each step in freed blocks
    evict_fraction: float = 0.4


@dataclass(slots=True)
class _Request:
    blocks: list[int]
    live: list[int]  # logical token ids in slot order: slot i holds live[i]
    num_written: int  # logical tokens written so far
    keys: torch.Tensor  # host, [max_tokens, kv_heads, head_dim] bf16
    values: torch.Tensor
    prompt_len: int


@dataclass(slots=True)
class HarnessResult:
    fence: bool
    drop_moves: bool
    device: str
    max_errors: list[float] = field(default_factory=list)
    num_moves: list[int] = field(default_factory=list)
    num_reused_blocks: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.max_errors) and max(self.max_errors) < TOLERANCE


def _slots(request: _Request, positions: Sequence[int], block_size: int) -> np.ndarray:
    return np.array(
        [request.blocks[p // block_size] * block_size + p % block_size for p in positions]
    )


class _Harness:
    def __init__(self, shape: HarnessShape, device: torch.device, seed: int) -> None:
        self.shape, self.device = shape, device
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = paged_layer_views(
            1, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
            torch.bfloat16, device, "LBNHC",
        )[0].zero_()  # fmt: skip
        self.free = list(range(shape.num_blocks))
        self.requests: list[_Request] = []
        self.repacker = SideStreamRepacker(device)

    def new_request(self, num_tokens: int, blocks: list[int]) -> _Request:
        """A request with ``num_tokens`` of prompt to write, in ``blocks`` first (then
        blocks from the free list; blocks it does not need go back to the list)."""
        shape = self.shape
        max_tokens = num_tokens + shape.num_steps + 1
        kv = torch.randn(
            2, max_tokens, shape.num_kv_heads, shape.head_dim, generator=self.generator
        ).bfloat16()
        need = math.ceil(num_tokens / shape.block_size)
        while len(blocks) < need:
            blocks.append(self.free.pop(0))
        request = _Request(blocks[:need], [], 0, kv[0], kv[1], num_tokens)
        self.free = blocks[need:] + self.free
        self.requests.append(request)
        return request

    def evict(self, request: _Request) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Evict a fraction of the request's older tokens; compact; free the tail blocks."""
        n, bs = len(request.live), self.shape.block_size
        candidates = n - 8  # the newest tokens stay
        gone = set(
            self.rng.choice(candidates, int(self.shape.evict_fraction * candidates), replace=False)
        )
        keep = [i for i in range(n) if i not in gone]
        num_live = len(keep)
        holes = [i for i in range(num_live) if i in gone]
        tail = [i for i in keep if i >= num_live]
        src, dst = _slots(request, tail, bs), _slots(request, holes, bs)
        moved_in = dict(zip(holes, tail, strict=True))  # slot order after the moves
        request.live = [request.live[moved_in.get(i, i)] for i in range(num_live)]
        need = math.ceil((num_live + 1) / bs)  # room for this step's decode token
        freed, request.blocks = request.blocks[need:], request.blocks[:need]
        return src, dst, freed

    def step(self, fence: bool, drop_moves: bool) -> tuple[float, int, int]:
        shape, bs = self.shape, self.shape.block_size
        victim = max(self.requests, key=lambda r: len(r.live))
        src, dst, freed = self.evict(victim)
        if not drop_moves:
            if self.device.type == "cuda":
                with torch.cuda.stream(self._side_stream()):
                    torch.cuda._sleep(SIDE_SLEEP_CYCLES)
            self.repacker.submit([self.cache], src, dst, LAYOUT)
            if fence:
                self.repacker.fence()
        newcomer = self.new_request(shape.new_prompt, list(freed))
        # Scheduler: positions to write this step (physical), per request.
        writes: list[tuple[_Request, range, list[int]]] = []
        for request in self.requests:
            if request is newcomer:
                logical = list(range(request.prompt_len))
            else:
                logical = [request.num_written]
                if len(request.live) + 1 > len(request.blocks) * bs:
                    request.blocks.append(self.free.pop(0))
            start = len(request.live)
            writes.append((request, range(start, start + len(logical)), logical))
            request.live += logical
            request.num_written += len(logical)
        if self.device.type == "cuda":
            torch.cuda._sleep(COMPUTE_SLEEP_CYCLES)
        outputs, queries = self._forward(writes)
        errors = [
            float((outputs[r] - self._reference(request, queries[r])).abs().max())
            for r, request in enumerate(self.requests)
        ]
        return max(errors), len(src), len(freed)

    def prefill(self, requests: list[_Request]) -> None:
        """A first step writing these requests' prompts."""
        writes = []
        for request in requests:
            logical = list(range(request.prompt_len))
            writes.append((request, range(request.prompt_len), logical))
            request.live, request.num_written = logical, request.prompt_len
        self._forward(writes)

    def _side_stream(self) -> torch.cuda.Stream:
        stream = self.repacker._stream  # the repacker's own side stream (delayed on purpose)
        assert stream is not None
        return stream

    def _upload(self, host: np.ndarray | torch.Tensor) -> torch.Tensor:
        """From pinned memory, ``non_blocking`` (as vLLM's runner uploads its inputs)."""
        tensor = (
            torch.from_numpy(np.ascontiguousarray(host)) if isinstance(host, np.ndarray) else host
        )
        if self.device.type != "cuda":
            return tensor.contiguous()
        return tensor.contiguous().pin_memory().to(self.device, non_blocking=True)

    def _forward(self, writes: list) -> tuple[torch.Tensor, torch.Tensor]:
        shape, bs = self.shape, self.shape.block_size
        slots = np.concatenate([_slots(r, positions, bs) for r, positions, _ in writes])
        new_keys = torch.cat([r.keys[logical] for r, _, logical in writes])
        new_values = torch.cat([r.values[logical] for r, _, logical in writes])
        keys, values = LAYOUT.keys_values(self.cache)
        slot_mapping = self._upload(slots.astype(np.int64))
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        keys[blocks, offsets] = self._upload(new_keys)
        values[blocks, offsets] = self._upload(new_values)
        max_blocks = max(len(r.blocks) for r in self.requests)
        table = np.zeros((len(self.requests), max_blocks), np.int64)
        for row, request in enumerate(self.requests):
            table[row, : len(request.blocks)] = request.blocks
        block_table = self._upload(table)
        seq_lens = self._upload(np.array([len(r.live) for r in self.requests], np.int64))
        queries = torch.randn(
            len(self.requests), shape.num_q_heads, shape.head_dim, generator=self.generator
        )
        q = self._upload(queries)
        k = keys[block_table].flatten(1, 2).float()  # [reqs, tokens, kv_heads, dim]
        v = values[block_table].flatten(1, 2).float()
        mask = torch.arange(k.shape[1], device=self.device)[None, :] < seq_lens[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None, None, :], enable_gqa=True,
        )[:, :, 0]  # fmt: skip
        if self.device.type != "cuda":
            return out, queries
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # vLLM's sampling reads its tokens back the same way
        return host, queries

    @staticmethod
    def _reference(request: _Request, query: torch.Tensor) -> torch.Tensor:
        live = torch.tensor(request.live)
        keys, values = request.keys[live].float(), request.values[live].float()
        return torch.nn.functional.scaled_dot_product_attention(
            query[None, :, None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            enable_gqa=True,
        )[0, :, 0]  # fmt: skip


def run_harness(
    device: torch.device | str,
    *,
    fence: bool = True,
    drop_moves: bool = False,
    shape: HarnessShape | None = None,
    seed: int = 0,
) -> HarnessResult:
    """The steps of the module docstring on ``device``; the result holds each step's
    largest difference from the host reference."""
    device = torch.device(device)
    shape = shape or HarnessShape()
    harness = _Harness(shape, device, seed)
    result = HarnessResult(fence, drop_moves, str(device))
    compute = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(compute) if compute is not None else nullcontext():
        first = [harness.new_request(length, []) for length in shape.first_prompts]
        harness.prefill(first)
        for _ in range(shape.num_steps):
            error, moves, reused = harness.step(fence, drop_moves)
            result.max_errors.append(error)
            result.num_moves.append(moves)
            result.num_reused_blocks.append(reused)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json_path", type=Path)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    fenced = run_harness(args.device, fence=True)
    unfenced = run_harness(args.device, fence=False)
    ok = fenced.passed and not unfenced.passed
    report = {
        "ok": ok,
        "tolerance": TOLERANCE,
        "fenced": asdict(fenced) | {"passed": fenced.passed},
        "negative_control_unfenced": asdict(unfenced) | {"passed": unfenced.passed},
    }
    args.json_path.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k == "ok"}))
    print(f"fenced: max error {max(fenced.max_errors):.2e} (must be < {TOLERANCE})")
    print(f"unfenced: max error {max(unfenced.max_errors):.2e} (must be >= {TOLERANCE})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
