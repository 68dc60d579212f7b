"""The query values an fp8 KV cache's logits use, as each CUDA backend forms them.

With ``kv_cache_dtype`` fp8 the logits of every wrapped backend are ``scale * k_scale *
q' . k`` over the float8 keys, where ``q'`` is:

- the query itself (bf16/fp16) when the backend reads it unquantized;
- ``q_fp8 * q_scale`` when the layer quantized the query before the impl (``query_quant``:
  the impl receives float8 rows);
- ``fp8(q / q_scale) * q_scale`` for FlashInfer, which quantizes the query itself inside
  ``forward`` (``maybe_quant_query`` with the layer's ``_q_scale``, vLLM's
  ``scaled_fp8_quant``: multiply by ``1 / q_scale`` in float32, clamp to the float8 range,
  round) and scales its logits by ``scale * q_scale * k_scale`` (``bmm1_scale``). Its
  metadata says which rows it quantizes: decode rows (the first ``num_decode_tokens``) to
  ``q_data_type_decode``, prefill rows to ``q_data_type_prefill`` (on SM90 the XQA decode
  keeps bf16 queries while the prefill quantizes).

``query_conversion`` returns the function ``QueryCapture.record`` applies to the gathered
rows, so the capture scores what the backend attends with.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.query_capture import QueryConversion

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_like_flashinfer(
    rows: torch.Tensor, q_scale: float, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """``fp8(rows / q_scale) * q_scale`` in float32, rounded as vLLM's ``scaled_fp8_quant``."""
    limit = torch.finfo(fp8_dtype).max
    # A Python scalar: a tensor made on the host would be a synchronising copy per layer.
    inverse = float(torch.tensor(1.0 / q_scale, dtype=torch.float32))  # rounded as float32
    quantized = (rows.float() * inverse).clamp(-limit, limit).to(fp8_dtype)
    return quantized.float() * q_scale


def query_conversion(
    layer: Any, attn_metadata: Any, query_dtype: torch.dtype, flashinfer_fp8_query: bool
) -> QueryConversion | None:
    """What ``record`` applies to a layer's gathered query rows over an fp8 cache
    (``None``: the rows as they are). ``rows`` are ``[n, heads, head_size]``;
    ``batch_rows`` their indices in the step's batch (decode rows come first)."""
    q_scale = float(layer._q_scale_float)
    if query_dtype in FP8_DTYPES:
        return lambda rows, batch_rows: rows.float() * q_scale
    if not flashinfer_fp8_query:
        return None
    decode_dtype = attn_metadata.q_data_type_decode
    prefill_dtype = attn_metadata.q_data_type_prefill
    num_decode_tokens = int(attn_metadata.num_decode_tokens)
    if decode_dtype not in FP8_DTYPES and prefill_dtype not in FP8_DTYPES:
        return None

    def convert(rows: torch.Tensor, batch_rows: torch.Tensor) -> torch.Tensor:
        decode = (
            quantize_like_flashinfer(rows, q_scale, decode_dtype)
            if decode_dtype in FP8_DTYPES
            else rows.float()
        )
        prefill = (
            quantize_like_flashinfer(rows, q_scale, prefill_dtype)
            if prefill_dtype in FP8_DTYPES
            else rows.float()
        )
        is_decode = (batch_rows < num_decode_tokens).view(-1, 1, 1)
        return torch.where(is_decode, decode, prefill)

    return convert
