"""The fused decode-mass kernel (every scored layer's decode rows in one launch) against
its torch reference, under the Triton interpreter on CPU (on the GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from kernels.attention_scores import ScoresBackend, summed_attention_mass
from kernels.fused_scores import DecodeRequests, fused_decode_mass, reference_decode_mass
from kernels.layout import KVLayout, paged_layer_views
from tests.kernels.conftest import DEVICE, triton_usable

pytestmark = pytest.mark.skipif(not triton_usable(), reason="Triton kernels cannot run here")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
CASES = [  # (kv_cache_layout, block_size, head_dim, q_heads, kv_heads, dtype)
    ("LBNHC", 16, 64, 6, 2, torch.float32),  # GQA 3
    ("LBHNC", 16, 32, 4, 4, torch.bfloat16),  # GQA 1
    ("BLHNC", 32, 80, 16, 2, torch.float16),  # GQA 8, head_dim not a power of two
    ("BHLNC", 16, 64, 32, 1, torch.bfloat16),  # GQA 32: rows past one tensor-core tile
    ("LBNHC", 16, 64, 8, 2, torch.float8_e4m3fn),  # fp8 stored as uint8, with k_scale
]


def _caches(name: str, case: tuple, num_layers: int, num_blocks: int) -> list[torch.Tensor]:
    _, block_size, head_dim, _, kv_heads, dtype = case
    storage = torch.uint8 if dtype in FP8 else dtype
    caches = paged_layer_views(
        num_layers, num_blocks, block_size, kv_heads, head_dim, storage, DEVICE, name, 8
    )
    base = caches[0].untyped_storage()
    whole = torch.empty(0, dtype=storage, device=DEVICE).set_(base)
    if dtype in FP8:
        whole.copy_(torch.randn(whole.numel()).mul(2).to(dtype).view(torch.uint8))
        return [cache.view(dtype) for cache in caches]
    whole.copy_(torch.randn(whole.numel()))
    return caches


def _step(case: tuple, seq_lens: list[int], num_layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    name, block_size, head_dim, q_heads, _, dtype = case
    blocks_each = max(-(-n // block_size) for n in seq_lens)
    num_blocks = blocks_each * len(seq_lens) + 3
    caches = _caches(name, case, num_layers, num_blocks)
    tables = torch.randperm(num_blocks)[: blocks_each * len(seq_lens)].view(len(seq_lens), -1)
    query_dtype = torch.bfloat16 if dtype in FP8 else dtype
    num_tokens = len(seq_lens) + 2
    queries = [
        torch.randn(num_tokens, q_heads, head_dim).to(query_dtype).to(DEVICE)
        for _ in range(num_layers)
    ]
    rows = torch.randperm(num_tokens)[: len(seq_lens)].tolist()  # any row of the step
    return caches, tables.int().to(DEVICE), queries, rows


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype is torch.float32 else 2e-4


@pytest.mark.parametrize("case", CASES)
def test_fused_mass_matches_the_reference(case: tuple) -> None:
    """Requests shorter than a key tile, crossing block and tile edges, and longer than
    several tiles, in three layers with their own scales; fewer programs than items."""
    seq_lens = [1, 70, 16, 129]
    caches, tables, queries, rows = _step(case, seq_lens)
    scales, k_scales = [0.11, None, 0.3], [0.5, 1.0, 2.0]
    if case[5] not in FP8:
        k_scales = [1.0, 1.0, 1.0]
    requests = DecodeRequests.build(tables, rows, seq_lens)
    got = fused_decode_mass(queries, caches, scales, requests, KVLayout.BHNC, k_scales=k_scales)
    default = case[2] ** -0.5
    effective = [s * k for s, k in zip([0.11, default, 0.3], k_scales, strict=True)]
    expected = reference_decode_mass(
        queries, caches, effective, tables, rows, seq_lens, KVLayout.BHNC
    )
    assert got.shape == (sum(seq_lens),) and got.dtype == torch.float32
    tolerance = _tolerance(case[5])
    torch.testing.assert_close(got, expected, atol=tolerance * 10, rtol=tolerance)
    # Every request's mass is one per layer and q head.
    offsets = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    for r in range(len(seq_lens)):
        total = got[offsets[r] : offsets[r + 1]].sum().item()
        assert total == pytest.approx(3 * case[3], rel=1e-4)


@pytest.mark.parametrize("programs", [1, 2, 5, 1000])
def test_any_number_of_programs_gives_the_same_mass(programs: int) -> None:
    """The persistent grid: one program doing every item, or one item each."""
    case = CASES[0]
    seq_lens = [33, 64, 5]
    caches, tables, queries, rows = _step(case, seq_lens, num_layers=2, seed=1)
    requests = DecodeRequests.build(tables, rows, seq_lens)
    got = fused_decode_mass(
        queries, caches, [0.2, 0.2], requests, KVLayout.BHNC, num_programs=programs
    )
    expected = reference_decode_mass(
        queries, caches, [0.2, 0.2], tables, rows, seq_lens, KVLayout.BHNC
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_capture_buffer_device_table_and_cpu_attn_layout() -> None:
    """Queries as layer views of one capture buffer, caches as separate ``cpu_attn``
    tensors, the request table from device tensors, added into a given output."""
    layout = KVLayout.CPU_ATTN
    torch.manual_seed(3)
    seq_lens, block_size, head_dim, q_heads, kv_heads = [20, 50], 16, 32, 4, 2
    caches = [
        layout.new_cache(10, block_size, kv_heads, head_dim, torch.float32, DEVICE).normal_()
        for _ in range(2)
    ]
    buffer = torch.randn(2, 5, q_heads, head_dim, device=DEVICE)
    tables = torch.tensor([[3, 1, 0, 0], [7, 2, 9, 4]], dtype=torch.int64, device=DEVICE)
    requests = DecodeRequests.from_device(
        tables, torch.tensor([4, 1], device=DEVICE), torch.tensor(seq_lens, device=DEVICE), 64
    )
    assert requests.total_keys == 128
    out = torch.ones(130, device=DEVICE)
    fused_decode_mass(list(buffer), caches, [None, None], requests, layout, out=out)
    expected = reference_decode_mass(
        list(buffer), caches, [head_dim**-0.5] * 2, tables, [4, 1], seq_lens, layout
    )
    torch.testing.assert_close(out[:70] - 1, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[70:], torch.ones(60))


def test_summed_attention_mass_uses_one_launch_for_the_decode_rows(monkeypatch) -> None:
    """The Triton path of ``summed_attention_mass``: decode rows through the fused kernel
    (launched once for every layer), a prefill chunk per layer; equal to the reference."""
    from kernels import _fused_scores_triton

    calls = []
    launch = _fused_scores_triton.launch_fused_decode_mass

    def counted(*args, **kwargs):
        calls.append(args[0])
        launch(*args, **kwargs)

    monkeypatch.setattr(_fused_scores_triton, "launch_fused_decode_mass", counted)
    case = CASES[0]
    seq_lens, query_lens = [40, 7, 33, 64], [1, 3, 1, 1]
    caches, tables, _, _ = _step(case, seq_lens, num_layers=3, seed=4)
    starts = [sum(query_lens[:r]) for r in range(len(seq_lens))]
    layers = [
        (torch.randn(sum(query_lens), case[3], case[2], device=DEVICE), cache, scale)
        for cache, scale in zip(caches, (0.1, 0.125, None), strict=True)
    ]
    got = summed_attention_mass(
        layers, tables, starts, query_lens, seq_lens, KVLayout.BHNC, backend=ScoresBackend.TRITON
    )
    expected = summed_attention_mass(
        layers, tables, starts, query_lens, seq_lens, KVLayout.BHNC,
        backend=ScoresBackend.REFERENCE,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scales": [0.1]}, "one cache and one scale per layer"),
        ({"queries": "mixed"}, "share shape"),
        ({"layout": KVLayout.CPU_ATTN_AMX}, "does not handle layout"),
        ({"queries": "heads"}, "do not match"),
        ({"caches": "uint8"}, "float8 view"),
    ],
)
def test_bad_arguments_raise(change: dict, message: str) -> None:
    case = CASES[0]
    caches, tables, queries, rows = _step(case, [10, 20], num_layers=2)
    scales: list[float | None] = change.get("scales", [0.1, 0.1])
    if change.get("queries") == "mixed":
        queries = [queries[0], queries[1][:-1]]
    if change.get("queries") == "heads":
        queries = [q[:, :5].contiguous() for q in queries]
    if change.get("caches") == "uint8":
        caches = [c.view(torch.uint8) for c in caches]
    requests = DecodeRequests.build(tables, rows, [10, 20])
    with pytest.raises(ValueError, match=message):
        fused_decode_mass(queries, caches, scales, requests, change.get("layout", KVLayout.BHNC))


def test_request_table_errors() -> None:
    tables = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        DecodeRequests.build(tables, [0, 1], [4, 0])
    with pytest.raises(ValueError, match="as many query rows"):
        DecodeRequests.build(tables, [0], [4, 5])
    with pytest.raises(ValueError, match="block_tables"):
        DecodeRequests.build(tables[:1], [0, 1], [4, 5])


def test_the_gpu_benchmark_runs_and_checks_its_mass() -> None:
    """``bench.fused_scores`` (run by the GPU check) on tiny shapes: its fused mass equals
    the per-layer kernels', and it reports every figure."""
    from bench.fused_scores import run_case

    case = run_case("smollm2", 2, 40, 2, DEVICE, 1, torch.float32)
    assert case["max_abs_diff"] < 1e-4
    assert case["fused_ms"] > 0 and case["attention_ms"] > 0 and case["target_met"] is None
    assert case["aliased_layers"] is False and case["layers"] == 2
