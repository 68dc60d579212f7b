"""What every stage of ``bench/gpu_check.sh`` needs before it can say anything about the
product: Python >= 3.11 (the code uses ``enum.StrEnum``), numpy, torch and Triton, a CUDA
device, and Triton able to build and run a kernel (its launcher needs a C compiler and
Python's headers). ``python -m bench.gpu_probe`` prints one line, what is missing or what
was found, and exits 1 or 0. Plain syntax (Python 3.6's), standard library first: it must
run, and say why, on an old Python.
"""

import sys

MIN_PYTHON = (3, 11)


def missing() -> str:
    """Why the GPU stages cannot run here; empty when they can."""
    if sys.version_info < MIN_PYTHON:
        found = ".".join(str(part) for part in sys.version_info[:3])
        wanted = ".".join(str(part) for part in MIN_PYTHON)
        return f"Python {found}; the checkout needs Python >= {wanted}"
    for module in ("numpy", "torch", "triton"):
        try:
            __import__(module)
        except Exception as error:  # noqa: BLE001 - any import failure is the reason
            return f"cannot import {module}: {error}"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to PyTorch"
    try:
        return run_triton_kernel()
    except Exception as error:  # noqa: BLE001 - a build or launch failure is the reason
        text = " ".join(str(error).split())[-300:]
        return f"Triton cannot build or run a kernel ({type(error).__name__}): {text}"


def run_triton_kernel(device: str = "cuda") -> str:
    """Build and run a kernel adding one to 100 integers on ``device``; why it went wrong
    (empty: it ran right). ``cpu`` runs it under ``TRITON_INTERPRET=1`` (the tests)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(pointer, count, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr style
        offsets = tl.arange(0, BLOCK)
        mask = offsets < count
        tl.store(pointer + offsets, tl.load(pointer + offsets, mask=mask) + 1, mask=mask)

    values = torch.arange(100, device=device, dtype=torch.int32)
    add_one[(1,)](values, 100, BLOCK=128)
    if device == "cuda":
        torch.cuda.synchronize()
    if not torch.equal(values.cpu(), torch.arange(1, 101, dtype=torch.int32)):
        return "a trivial Triton kernel ran but wrote wrong values"
    return ""


def main() -> int:
    reason = missing()
    if reason:
        print(reason)
        return 1
    import numpy
    import torch
    import triton

    python = ".".join(str(part) for part in sys.version_info[:3])
    print(
        f"Python {python}, numpy {numpy.__version__}, torch {torch.__version__}, Triton "
        f"{triton.__version__}, {torch.cuda.get_device_name()}: a Triton kernel ran"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
