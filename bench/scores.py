"""`vtoken bench scores`: attention-score time vs the attention of the same step, one layer.

For each shape, seq_len and q_len (1: decode; 32: a SnapKV observation window): the
dispatcher's ``attention_scores`` for one request and one layer, against attention over
the same paged keys: SDPA (GQA, causal offset mask) on K and V gathered through the block
table, which does the same gather work. ``ratio = scores_ms / attention_ms``. Both are
timed as ``vtoken bench repack`` times its functions (``bench.repack.measure_interleaved``):
repetitions interleaved, each call warmed by an untimed one right before, medians.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kernels.intmath import cdiv

if TYPE_CHECKING:
    import torch

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # q_heads, kv_heads, head_dim


def sdpa_attention(
    query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, layout: Any
) -> torch.Tensor:
    """Attention output ``[q_len, q_heads, head_dim]`` over the paged keys and values."""
    import torch

    block_size = layout.block_size(cache)
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    keys, values = (part[blocks].flatten(0, 1)[:seq_len] for part in layout.keys_values(cache))
    q_len = query.shape[0]
    visible = torch.arange(seq_len, device=query.device).view(1, -1) <= (
        seq_len - q_len + torch.arange(q_len, device=query.device).view(-1, 1)
    )
    return torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=visible,
        enable_gqa=True,
    ).transpose(0, 1)


def run_case(
    shape: str, seq_len: int, q_len: int, device: torch.device, reps: int, dtype: torch.dtype
) -> dict[str, Any]:
    import torch

    from bench.repack import measure_interleaved
    from kernels.attention_scores import attention_scores
    from kernels.layout import KVLayout

    q_heads, kv_heads, head_dim = SHAPES[shape]
    layout = KVLayout.FLASH if device.type == "cuda" else KVLayout.CPU_ATTN
    block_size = 16 if device.type == "cuda" else 32
    num_blocks = 2 * cdiv(seq_len, block_size)
    cache = layout.new_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device).normal_()
    block_table = torch.randperm(num_blocks, device=device)[: num_blocks // 2].int()
    query = torch.randn(q_len, q_heads, head_dim, device=device, dtype=dtype)
    times = measure_interleaved(
        {
            "scores": lambda: attention_scores(query, cache, block_table, seq_len, layout),
            "attention": lambda: sdpa_attention(query, cache, block_table, seq_len, layout),
        },
        device,
        reps,
        cold=False,
    )
    scores_ms, attention_ms = times["scores"], times["attention"]
    return {
        "shape": shape,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "seq_len": seq_len,
        "q_len": q_len,
        "scores_ms": round(scores_ms, 4),
        "attention_ms": round(attention_ms, 4),
        "ratio": round(scores_ms / attention_ms, 3),
    }


def cli(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    shapes: Annotated[str, typer.Option(help="Comma list of " + ",".join(SHAPES))] = ",".join(
        SHAPES
    ),
    seq_lens: Annotated[str, typer.Option(help="Comma list of sequence lengths.")] = "1024,4096",
    q_lens: Annotated[str, typer.Option(help="Comma list of query lengths.")] = "1,32",
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement.")] = 11,
    dtype: Annotated[str, typer.Option(help="Query and KV cache dtype.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
) -> None:
    """Time attention_scores against SDPA attention of the same step; JSON output."""
    import torch

    chosen = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    cases = []
    for shape in shapes.split(","):
        for seq_len in (int(s) for s in seq_lens.split(",")):
            for q_len in (int(q) for q in q_lens.split(",")):
                case = run_case(shape, seq_len, q_len, chosen, reps, getattr(torch, dtype))
                cases.append(case)
                typer.echo(
                    f"{shape:8} seq={seq_len:<5} q={q_len:<3} scores {case['scores_ms']:8.3f} ms"
                    f"  attention {case['attention_ms']:8.3f} ms  ratio {case['ratio']:.2f}"
                )
    name = torch.cuda.get_device_name() if chosen.type == "cuda" else "cpu"
    result = {
        "device": name,
        "attention": "sdpa over gathered pages",
        "statistic": "median of interleaved warm repetitions",
        "reps": reps,
        "cases": cases,
    }
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
