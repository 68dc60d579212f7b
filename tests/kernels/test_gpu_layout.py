"""vLLM 0.32's GPU KV layout (``bhnc`` views under every ``KVCacheLayout``): our views are
vLLM's, vLLM's own cache-write kernel reads back through our offsets, and the repack and
score kernels match the torch references on odd shapes, strides and dtypes (fp8 included).

Without a GPU the Triton kernels run under ``TRITON_INTERPRET=1`` (``conftest.py``).
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from kernels import score_spans
from kernels.attention_scores import (
    ScoresBackend,
    attention_scores,
    batch_attention_scores,
    reference_attention_scores,
)
from kernels.layout import KV_CACHE_LAYOUTS, KVLayout, paged_layer_views, resolve_kv_cache_layout
from kernels.repack import RepackBackend, reference_repack, repack
from tests.kernels.conftest import DEVICE, triton_usable

LAYOUT = KVLayout.BHNC
LAYOUT_NAMES = list(KV_CACHE_LAYOUTS)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _views(
    name: str,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    padding: int = 0,
    num_layers: int = 3,
) -> list[torch.Tensor]:
    """Layer views filled with distinct finite values (fp8 caches are stored as uint8)."""
    storage = torch.uint8 if dtype in FP8 else dtype
    caches = paged_layer_views(
        num_layers, num_blocks, block_size, kv_heads, head_dim, storage, DEVICE, name, padding
    )
    base = caches[0].as_strided(
        (caches[0].untyped_storage().nbytes() // caches[0].element_size(),), (1,), 0
    )
    if dtype in FP8:
        base.copy_(torch.randn(base.shape, device=DEVICE).to(dtype).view(torch.uint8))
    else:
        base.copy_(torch.randn(base.shape, device=DEVICE).to(dtype))
    return caches


def _storage(caches: list[torch.Tensor]) -> torch.Tensor:
    first = caches[0]
    return first.as_strided((first.untyped_storage().nbytes() // first.element_size(),), (1,), 0)


# ---------------------------------------------------------------------------- the views


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_paged_views_have_vllms_strides(name: str) -> None:
    """Same strides and offsets as vLLM's ``compute_layout_strides``/``create_kv_cache_views``."""
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    num_layers, num_blocks, block_size, kv_heads, head_dim = 3, 5, 16, 2, 64
    dtype = torch.bfloat16
    spec = interface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype
    )
    layout = KVCacheLayout[name]
    byte_strides = interface.compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    tensor = interface.KVCacheTensor(
        size=size,
        layers=[f"layer.{i}" for i in range(num_layers)],
        layer_stride=byte_strides[0],
        block_stride=byte_strides[1],
    )
    raw = torch.zeros(size, dtype=torch.int8)
    theirs = interface.create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    ours = paged_layer_views(
        num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu", name
    )
    assert len(theirs) == len(ours)
    for layer, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert a.shape == b.shape and a.stride() == b.stride(), (layer, a.stride(), b.stride())
        assert a.storage_offset() == b.storage_offset()
    assert KV_CACHE_LAYOUTS[name] == layout.stride_order


def test_layout_names_and_aliases() -> None:
    assert resolve_kv_cache_layout("nhd") == KV_CACHE_LAYOUTS["LBNHC"]
    assert resolve_kv_cache_layout("HND") == KV_CACHE_LAYOUTS["LBHNC"]
    with pytest.raises(ValueError, match="unknown KV cache layout 'LNBHC'"):
        resolve_kv_cache_layout("LNBHC")


def _vllm_triton_cache_write() -> types.ModuleType:
    """vLLM's Triton backend cache-write op, loaded with real Triton (vLLM's CPU build
    stubs Triton out) so it runs under the interpreter on CPU tensors."""
    spec = importlib.util.find_spec("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    with open(spec.origin) as file:
        source = file.read()
    source = source.replace(
        "from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl"
    ).replace("torch.cuda.get_device_capability(key.device)[0] < 9", "False")
    module = types.ModuleType("vllm_triton_cache_write")
    module.__file__ = spec.origin
    exec(compile(source, spec.origin, "exec"), module.__dict__)  # noqa: S102
    return module


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize(("dtype", "block_size", "head_dim"), [
    (torch.bfloat16, 16, 64), (torch.float16, 32, 128),
])  # fmt: skip
def test_vllm_cache_write_reads_back(
    name: str, dtype: torch.dtype, block_size: int, head_dim: int
) -> None:
    """K and V written by vLLM's own kernel, split as its backends split the view
    (``kv_cache.transpose(1, 2).split(head_size, -1)``), are where our offsets say."""
    if DEVICE.type != "cpu" or not triton_usable():
        pytest.skip("the probe runs vLLM's kernel under the Triton interpreter")
    write = _vllm_triton_cache_write()
    kv_heads, num_blocks = 2, 5
    cache = _views(name, num_blocks, block_size, kv_heads, head_dim, dtype, padding=8)[1]
    key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    slots = torch.randperm(num_blocks * block_size)[:23]
    keys = torch.randn(23, kv_heads, head_dim).to(dtype)
    values = torch.randn(23, kv_heads, head_dim).to(dtype)
    one = torch.ones(1)
    write.triton_reshape_and_cache_flash(
        keys, values, key_cache, value_cache, slots, "auto", one, one
    )
    read = LAYOUT.gather(cache, slots)
    assert torch.equal(read[:, 0], keys)
    assert torch.equal(read[:, 1], values)
    got_keys, got_values = LAYOUT.keys_values(cache)
    assert torch.equal(got_keys[slots // block_size, slots % block_size], keys)
    assert torch.equal(got_values[slots // block_size, slots % block_size], values)


# ---------------------------------------------------------------------------- repack

REPACK_CASES = [  # (block_size, kv_heads, head_dim, dtype, num_moves)
    (16, 1, 64, torch.bfloat16, 37),
    (32, 4, 128, torch.float16, 70),
    (64, 8, 64, torch.float8_e4m3fn, 90),
]


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize(("block_size", "kv_heads", "head_dim", "dtype", "num_moves"), REPACK_CASES)
def test_repack_on_vllm_views(
    name: str, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, num_moves: int
) -> None:
    """Every backend moves exactly the reference's bytes: the whole buffer (other layers,
    block padding) is compared, so a write through a wrong stride is caught."""
    num_blocks = 2 * num_moves // block_size + 3
    caches = _views(name, num_blocks, block_size, kv_heads, head_dim, dtype, padding=24)
    perm = torch.randperm(
        num_blocks * block_size, generator=torch.Generator().manual_seed(num_moves)
    )
    src, dst = perm[:num_moves].to(DEVICE), perm[num_moves : 2 * num_moves].to(DEVICE)
    before = _storage(caches).clone()
    reference_repack(caches, src, dst, LAYOUT)
    expected = _storage(caches).clone()
    assert not torch.equal(expected, before)
    backends = [
        RepackBackend.TORCH,
        RepackBackend.CPU if DEVICE.type == "cpu" else RepackBackend.TRITON,
    ]
    if triton_usable() and RepackBackend.TRITON not in backends:
        backends.append(RepackBackend.TRITON)
    for backend in backends:
        _storage(caches).copy_(before)
        repack(caches, src, dst, LAYOUT, backend=backend)
        assert torch.equal(_storage(caches), expected), backend


def test_repack_rejects_layers_of_different_strides() -> None:
    a = paged_layer_views(2, 4, 16, 2, 32, torch.bfloat16, "cpu", "LBNHC")
    b = paged_layer_views(2, 4, 16, 2, 32, torch.bfloat16, "cpu", "LBHNC")
    with pytest.raises(ValueError, match="layer caches differ"):
        repack([a[0], b[0]], torch.tensor([1]), torch.tensor([2]), LAYOUT)


# ---------------------------------------------------------------------------- scores

SCORE_CASES = [  # (block_size, head_dim, num_q_heads, num_kv_heads, dtype, k_scale)
    (16, 64, 2, 2, torch.bfloat16, 1.0),  # GQA 1
    (32, 128, 16, 4, torch.float16, 1.0),  # GQA 4
    (64, 64, 16, 2, torch.float8_e4m3fn, 0.37),  # GQA 8, fp8 with a scale
    (16, 128, 8, 2, torch.float8_e5m2, 2.5),
]


def _score_inputs(name: str, case: tuple, seq_lens: list[int], q_lens: list[int]):
    block_size, head_dim, num_q_heads, num_kv_heads, dtype, k_scale = case
    blocks_each = max(-(-s // block_size) for s in seq_lens)
    num_blocks = blocks_each * len(seq_lens) + 2
    cache = _views(name, num_blocks, block_size, num_kv_heads, head_dim, dtype, padding=8)[1]
    if dtype in FP8:
        cache = cache.view(dtype)
    tables = torch.randperm(num_blocks)[: blocks_each * len(seq_lens)].view(len(seq_lens), -1)
    query = torch.randn(sum(q_lens) + 1, num_q_heads, head_dim).to(
        torch.bfloat16 if dtype in FP8 else dtype
    )
    starts = [1 + sum(q_lens[:r]) for r in range(len(q_lens))]  # row 0 is another request's
    return query.to(DEVICE), cache, tables.int().to(DEVICE), starts, k_scale


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLHNC", "BHLNC"])
@pytest.mark.parametrize("case", SCORE_CASES)
def test_batch_scores_match_reference(name: str, case: tuple) -> None:
    """Decode rows, a multi-token chunk and a row ending on a block edge, in one batch."""
    seq_lens, q_lens = [70, 3 * case[0], 129], [1, 5, 1]
    query, cache, tables, starts, k_scale = _score_inputs(name, case, seq_lens, q_lens)
    tolerance = 1e-4 if case[4] in FP8 or case[4] is torch.float16 else 2e-4
    backends = [ScoresBackend.TORCH] + ([ScoresBackend.TRITON] if triton_usable() else [])
    for backend in backends:
        got = batch_attention_scores(
            query, cache, tables, starts, q_lens, seq_lens, LAYOUT,
            scale=0.11, k_scale=k_scale, backend=backend,
        )  # fmt: skip
        assert got.shape == (cache.shape[1], sum(seq_lens))
        offset = 0
        for r, seq_len in enumerate(seq_lens):
            rows = query[starts[r] : starts[r] + q_lens[r]]
            expected = reference_attention_scores(
                rows, cache, tables[r], seq_len, LAYOUT, scale=0.11 * k_scale
            )
            torch.testing.assert_close(
                got[:, offset : offset + seq_len], expected, atol=tolerance, rtol=1e-4
            )
            offset += seq_len


def test_long_requests_are_scored_in_query_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits over the budget: a request alone is split into query chunks (launched one
    after another, adding into the same columns), the others batched around it."""
    if not triton_usable():
        pytest.skip("Triton unusable here")
    monkeypatch.setattr(score_spans, "MAX_LOGITS", 4 * 40 * 3)
    case = (16, 64, 4, 2, torch.float32, 1.0)
    seq_lens, q_lens = [40, 50, 33], [1, 9, 2]
    query, cache, tables, starts, _ = _score_inputs("LBNHC", case, seq_lens, q_lens)
    got = batch_attention_scores(
        query, cache, tables, starts, q_lens, seq_lens, LAYOUT, backend=ScoresBackend.TRITON
    )
    expected = batch_attention_scores(
        query, cache, tables, starts, q_lens, seq_lens, LAYOUT, backend=ScoresBackend.REFERENCE
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # Row sums: each query row's softmax sums to one.
    torch.testing.assert_close(got[:, 40:90].sum(1), torch.full((2,), 9 * 2.0, device=DEVICE))


def test_single_request_api_agrees_with_the_batch() -> None:
    case = (32, 64, 8, 2, torch.bfloat16, 1.0)
    query, cache, tables, starts, _ = _score_inputs("BLHNC", case, [77], [3])
    rows = query[starts[0] : starts[0] + 3]
    single = attention_scores(rows, cache, tables[0], 77, LAYOUT)
    batch = batch_attention_scores(query, cache, tables, starts, [3], [77], LAYOUT)
    torch.testing.assert_close(single, batch, atol=1e-5, rtol=1e-5)


def test_scores_refuse_raw_fp8_bytes() -> None:
    case = (16, 64, 2, 2, torch.float8_e4m3fn, 1.0)
    query, cache, tables, starts, _ = _score_inputs("LBNHC", case, [20], [1])
    with pytest.raises(ValueError, match="float8 view"):
        attention_scores(query[:1], cache.view(torch.uint8), tables[0], 20, LAYOUT)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query_lens": [1, 1]}, "differ in length"),
        ({"query_starts": [30]}, "outside the query"),
        ({"seq_lens": [10**4]}, "cannot hold"),
    ],
)
def test_batch_rejects_bad_arguments(change: dict, message: str) -> None:
    case = (16, 64, 2, 2, torch.bfloat16, 1.0)
    query, cache, tables, starts, _ = _score_inputs("LBNHC", case, [20], [2])
    args = {"query_starts": starts, "query_lens": [2], "seq_lens": [20]} | change
    with pytest.raises(ValueError, match=message):
        batch_attention_scores(
            query, cache, tables, args["query_starts"], args["query_lens"], args["seq_lens"],
            LAYOUT,
        )  # fmt: skip


def test_vector_alignment_promises_only_what_holds() -> None:
    from kernels.layout import vector_alignment

    caches = paged_layer_views(2, 4, 16, 2, 64, torch.bfloat16, "cpu", "LBNHC")
    assert vector_alignment(caches, [256, 128, 0], 1) == 8  # 16 bytes of bf16
    assert vector_alignment(caches, [256, 124, 0], 1) == 4
    assert vector_alignment(caches, [256, 128, 1], 1) == 1
    assert vector_alignment(caches, [256, 128], 2) == 1  # strided channels: no vectors
    odd = paged_layer_views(2, 4, 16, 2, 64, torch.bfloat16, "cpu", "LBNHC", block_padding=3)
    assert vector_alignment(odd, [odd[0].stride(0)], 1) == 1
    fp8 = paged_layer_views(2, 4, 16, 2, 64, torch.uint8, "cpu", "BLHNC")
    assert vector_alignment(fp8, [fp8[0].stride(0), 128, 256], 1) == 16
