"""`vtoken bench scores`: attention-score time vs the attention of the same batch, one layer.

For each shape, batch size, seq_len and q_len (1: decode; 32: a SnapKV observation window):
``batch_attention_scores`` for the batch's requests in one call (on CUDA: the Triton
kernels over vLLM 0.32's GPU view ``bhnc``, strided as ``LBNHC``, the default layout on
Hopper), against attention of the same batch:

- ``attention_ms``: SDPA over K and V already gathered into contiguous ``[batch, kv_heads,
  seq_len, head_dim]`` (not timed): the attention kernel alone, a lower bound of a paged
  decode kernel's time, which reads the same bytes through a block table;
- ``paged_attention_ms`` (informational): the gather through the block table, then SDPA.

``ratio = scores_ms / attention_ms``. Timed as ``vtoken bench repack`` times its functions
(``bench.timing.measure_interleaved``): repetitions interleaved, each call warmed by an
untimed one right before, medians.

The target on a GPU (``GPU_TARGET``, the run's ``target``): at decode (q_len 1) and batch
>= 32, scores <= 1.0x the decode attention of the same batch, judged on the device's time
alone (``device_ratio``) where the launches were hidden, else on ``ratio``. Such a CUDA
case records ``target_met``; every other case (a smaller batch, a longer query, any CPU
case) records ``None``: it has no target.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bench.common import csv_items, write_json
from kernels.intmath import cdiv

if TYPE_CHECKING:
    import torch

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # q_heads, kv_heads, head_dim
GPU_TARGET_RATIO = 1.0
GPU_TARGET_MIN_BATCH = 32
GPU_TARGET = (
    f"decode (q_len 1) at batch >= {GPU_TARGET_MIN_BATCH} on CUDA: scores at <= "
    f"{GPU_TARGET_RATIO}x the decode attention of the same batch, on device_ratio where the "
    "launches were hidden, else ratio"
)


def gpu_target_met(ratio: float, device_ratio: float | None) -> bool:
    """``GPU_TARGET``'s ratio rule (0.0 is a measured device ratio, not a missing one)."""
    return (device_ratio if device_ratio is not None else ratio) <= GPU_TARGET_RATIO


def case_target_met(
    device_type: str, batch: int, q_len: int, ratio: float, device_ratio: float | None
) -> bool | None:
    """``target_met`` of a case: ``GPU_TARGET`` judged for a decode case at batch >=
    ``GPU_TARGET_MIN_BATCH`` on CUDA, ``None`` for every other case (no target)."""
    if device_type != "cuda" or q_len != 1 or batch < GPU_TARGET_MIN_BATCH:
        return None
    return gpu_target_met(ratio, device_ratio)


def _causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """vLLM's rule (query ``i`` sees keys ``j <= seq_len - q_len + i``); None for decode."""
    import torch

    if q_len == 1:
        return None
    return torch.arange(seq_len, device=device).view(1, -1) <= (
        seq_len - q_len + torch.arange(q_len, device=device).view(-1, 1)
    )


def sdpa_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``query`` ``[batch, q_heads, q_len, head_dim]`` over ``keys``/``values`` ``[batch,
    kv_heads, seq_len, head_dim]`` (GQA)."""
    import torch

    return torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, enable_gqa=True
    )


def gather_pages(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int, layout: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every request: ``[batch, kv_heads, seq_len, head_dim]`` each (copies)."""
    block_size = layout.block_size(cache)
    blocks = block_tables[:, : cdiv(seq_len, block_size)].long()
    return tuple(  # type: ignore[return-value]
        part[blocks].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
        for part in layout.keys_values(cache)
    )


def run_case(
    shape: str,
    batch: int,
    seq_len: int,
    q_len: int,
    device: torch.device,
    reps: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    import torch

    from bench.timing import device_only_times, measure_interleaved, rounded_ms
    from kernels.attention_scores import batch_attention_scores
    from kernels.layout import KVLayout, paged_layer_views

    q_heads, kv_heads, head_dim = SHAPES[shape]
    if device.type == "cuda":
        layout, block_size = KVLayout.BHNC, 16
        blocks_each = cdiv(seq_len, block_size)
        cache = paged_layer_views(
            1, 2 * batch * blocks_each, block_size, kv_heads, head_dim, dtype, device
        )[0]
    else:
        layout, block_size = KVLayout.CPU_ATTN, 32
        blocks_each = cdiv(seq_len, block_size)
        cache = layout.new_cache(2 * batch * blocks_each, block_size, kv_heads, head_dim, dtype)
    whole = cache.untyped_storage().nbytes() // cache.element_size()
    cache.as_strided((whole,), (1,), 0).normal_()
    block_tables = (
        torch.randperm(2 * batch * blocks_each, device=device)[: batch * blocks_each]
        .view(batch, blocks_each)
        .int()
    )
    query = torch.randn(batch * q_len, q_heads, head_dim, device=device, dtype=dtype)
    starts, q_lens, seq_lens = (
        [r * q_len for r in range(batch)], [q_len] * batch, [seq_len] * batch,
    )  # fmt: skip
    batched_query = query.view(batch, q_len, q_heads, head_dim).transpose(1, 2)
    keys, values = gather_pages(cache, block_tables, seq_len, layout)
    mask = _causal_mask(q_len, seq_len, device)

    def paged_attention() -> torch.Tensor:
        return sdpa_attention(
            batched_query, *gather_pages(cache, block_tables, seq_len, layout), mask
        )

    times = measure_interleaved(
        {
            "scores": lambda: batch_attention_scores(
                query, cache, block_tables, starts, q_lens, seq_lens, layout, check=False
            ),
            "attention": lambda: sdpa_attention(batched_query, keys, values, mask),
            "paged_attention": paged_attention,
        },
        device,
        reps,
        cold=False,
        device_only=("scores", "attention"),
    )
    scores_ms, attention_ms = times["scores"], times["attention"]
    device_ms = device_only_times(times, ("scores", "attention"))
    scores_device, attention_device = device_ms["scores"], device_ms["attention"]
    device_ratio = (
        round(scores_device / attention_device, 3) if scores_device and attention_device else None
    )
    return {
        "shape": shape,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "seq_len": seq_len,
        "q_len": q_len,
        "key_mb": round(batch * seq_len * kv_heads * head_dim * cache.element_size() / 1e6, 1),
        "scores_ms": round(scores_ms, 4),
        "attention_ms": round(attention_ms, 4),
        "paged_attention_ms": round(times["paged_attention"], 4),
        "ratio": round(scores_ms / attention_ms, 3),
        "ratio_paged": round(scores_ms / times["paged_attention"], 3),
        # CUDA: the device's time alone (launches queued behind a spin: measure_interleaved)
        "scores_device_ms": rounded_ms(scores_device),
        "attention_device_ms": rounded_ms(attention_device),
        "device_ratio": device_ratio,
        "launch_hidden": {name: times.get(f"{name}_launch_hidden") for name in device_ms},
        "target_met": case_target_met(
            device.type, batch, q_len, scores_ms / attention_ms, device_ratio
        ),
    }


def cli(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    shapes: Annotated[str, typer.Option(help="Comma list of " + ",".join(SHAPES))] = ",".join(
        SHAPES
    ),
    batches: Annotated[str, typer.Option(help="Comma list of batch sizes (requests).")] = "1,32",
    seq_lens: Annotated[str, typer.Option(help="Comma list of sequence lengths.")] = "1024,4096",
    q_lens: Annotated[str, typer.Option(help="Comma list of query lengths.")] = "1,32",
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement.")] = 11,
    dtype: Annotated[str, typer.Option(help="Query and KV cache dtype.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
) -> None:
    """Time batch_attention_scores against SDPA attention of the same batch; JSON output."""
    import torch

    chosen = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    cases = []
    for shape in csv_items(shapes):
        for batch in (int(b) for b in csv_items(batches)):
            for seq_len in (int(s) for s in csv_items(seq_lens)):
                for q_len in (int(q) for q in csv_items(q_lens)):
                    case = run_case(
                        shape, batch, seq_len, q_len, chosen, reps, getattr(torch, dtype)
                    )
                    cases.append(case)
                    typer.echo(
                        f"{shape:8} batch={batch:<3} seq={seq_len:<5} q={q_len:<3} scores "
                        f"{case['scores_ms']:8.3f} ms  attention {case['attention_ms']:8.3f} ms"
                        f"  ratio {case['ratio']:.2f}  (paged {case['ratio_paged']:.2f})"
                    )
    name = torch.cuda.get_device_name() if chosen.type == "cuda" else "cpu"
    result = {
        "device": name,
        "attention": "sdpa over contiguous K/V of the batch (paged: gather + sdpa)",
        "statistic": "median of interleaved warm repetitions",
        "target": GPU_TARGET if chosen.type == "cuda" else None,
        "reps": reps,
        "cases": cases,
    }
    if json_path is not None:
        write_json(json_path, result, indent=1)
