"""``bench/gpu_check.sh`` runs from a checkout where only torch and triton are installed:
the kernels, their tests' imports and the kernel benchmarks must not need the serving stack."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = ("pydantic", "vllm", "ray", "redis", "fastapi")


def test_kernel_benchmarks_import_without_the_serving_stack() -> None:
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in BLOCKED)
        + "import kernels, kernels.async_repack, kernels.attention_scores\n"
        "import bench.repack, bench.scores, bench.fused_scores, bench.runner_harness\n"
        "import bench.timing, bench.gpu_verdict\n"
        "import kernels.fused_scores\n"
        "from vtoken import repack_planner, token_table\n"
        "bench.repack.make_moves('compact50', 16)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
