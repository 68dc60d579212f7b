"""Published GPU serving throughput: the rows gate (c) compares the step-time model with.

Source: TensorRT-LLM's "Performance Overview", the revision that introduced RTX 6000 Pro
data "NEW for v1.0", in the TensorRT-LLM repository at commit
``00f37686aa854010d68bcbd0f4ab000221541ca6``, file ``docs/source/performance/perf-overview.md``
(``SOURCE["url"]``). Later revisions (``developer-guide/perf-overview.md``) report per-GPU
throughput and no longer list Llama 3.1 8B.

What the table says of itself:

- metric: ``Total Output Throughput (tokens/sec)`` of ``trtllm-bench throughput``, "a local
  inference client fed requests at an infinite rate": an offline, saturating run (all
  requests queued at once), output tokens over the time from the first request to the last
  completion;
- engine: TensorRT-LLM's PyTorch backend, CUDA graphs with padding, its default scheduler
  (``GUARANTEED_NO_EVICT``: a request starts only when its prompt and all its outputs fit,
  and is never paused; https://nvidia.github.io/TensorRT-LLM/performance/performance-tuning-guide/useful-runtime-flags.html);
- data: ``prepare_dataset.py token-norm-dist`` with standard deviation 0: every request has
  exactly ISL random prompt tokens and OSL outputs; ``num_requests`` per (ISL, OSL) from
  the page's table;
- models: ModelOpt FP8 checkpoints ``nvidia/Llama-3.1-8B-Instruct-FP8`` and
  ``nvidia/Llama-3.3-70B-Instruct-FP8`` (FP8 weights; the page does not state the KV cache's
  precision). Llama 3.3 70B has Llama 3.1 70B's shapes (the same ``config.json`` sizes), so it
  runs with ``MODELS["llama-3.1-70b"]``;
- GPUs: H100 SXM 80GB (DGX H100) and H200 SXM 141GB (DGX H200).

``output_tps`` is the table's figure, for the whole TP group (the 70B H100 column is TP2:
per GPU it is half).
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = {
    "title": "TensorRT-LLM Performance Overview (v1.0 revision)",
    "url": (
        "https://github.com/NVIDIA/TensorRT-LLM/blob/00f37686aa854010d68bcbd0f4ab000221541ca6"
        "/docs/source/performance/perf-overview.md"
    ),
    "commit": "00f37686aa854010d68bcbd0f4ab000221541ca6",
    "metric": "Total Output Throughput (tokens/sec), trtllm-bench throughput",
    "scheduler": "GUARANTEED_NO_EVICT (TensorRT-LLM's default capacity scheduler)",
}


@dataclass(frozen=True, slots=True)
class PublishedRow:
    """One published figure: ``output_tps`` output tokens/s of a TP group of ``gpu``."""

    model: str  # the table's name
    shape: str  # the cost model's MODELS key
    gpu: str  # the cost model's DEVICES key
    dtype: str
    tp: int
    isl: int
    osl: int
    output_tps: float
    num_requests: int

    @property
    def key(self) -> str:
        return f"{self.shape}/{self.gpu}/tp{self.tp}/{self.isl}-{self.osl}"

    @property
    def per_gpu_tps(self) -> float:
        return self.output_tps / self.tp


# The page's "Reproducing Benchmarked Results" table: requests per (ISL, OSL).
NUM_REQUESTS = {
    (128, 128): 30000,
    (128, 2048): 3000,
    (128, 4096): 1500,
    (500, 2000): 3000,
    (1000, 1000): 3000,
    (1000, 2000): 1500,
    (2048, 128): 3000,
    (2048, 2048): 1500,
    (5000, 500): 1500,
    (20000, 2000): 1000,
}

# (ISL, OSL): (H200 TP1 FP8, H100 TP1 FP8), section "Llama 3.1 8B".
LLAMA_8B = {
    (128, 128): (27911, 28312),
    (128, 2048): (26221, 22714),
    (128, 4096): (18027, 14325),
    (500, 2000): (20770, 17660),
    (1000, 1000): (17744, 15220),
    (1000, 2000): (16828, 13899),
    (2048, 128): (3538, 3450),
    (2048, 2048): (12194, 9305),
    (5000, 500): (3902, 3459),
    (20000, 2000): (1804, 1351),
}

# (ISL, OSL): (H200 TP1 FP8, H100 TP2 FP8), section "Llama 3.3 70B".
LLAMA_70B = {
    (128, 128): (3803, 6378),
    (128, 2048): (4336, 6651),
    (128, 4096): (2872, 4199),
    (500, 2000): (3666, 5222),
    (1000, 1000): (2909, 4205),
    (1000, 2000): (2994, 4146),
    (2048, 128): (442, 762),
    (2048, 2048): (2003, 3082),
    (5000, 500): (566, 898),
    (20000, 2000): (283, 437),
}


def _rows() -> tuple[PublishedRow, ...]:
    rows = []
    columns = (
        ("Llama 3.1 8B", "llama-3.1-8b", LLAMA_8B, (("h200", 1), ("h100", 1))),
        ("Llama 3.3 70B", "llama-3.1-70b", LLAMA_70B, (("h200", 1), ("h100", 2))),
    )
    for name, shape, table, gpus in columns:
        for (gpu, tp), index in zip(gpus, (0, 1), strict=True):
            for (isl, osl), figures in table.items():
                rows.append(
                    PublishedRow(name, shape, gpu, "fp8", tp, isl, osl, float(figures[index]),
                                 NUM_REQUESTS[(isl, osl)])
                )  # fmt: skip
    return tuple(rows)


ROWS = _rows()
