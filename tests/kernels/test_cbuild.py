"""Building the C files: once per cache directory, OpenMP only where it shares torch's
runtime, a plain build when the OpenMP one fails, ``None`` without a compiler."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
import torch

from kernels import cbuild, repack_cpu
from kernels.cbuild import compile_library
from kernels.layout import KVLayout
from kernels.repack import reference_repack


def _logging_compiler(tmp_path: Path, real: str) -> tuple[Path, Path]:
    """A ``cc`` that logs each build (a call with ``-o``), then runs the real one."""
    calls = tmp_path / "calls"
    fake = tmp_path / "cc"
    fake.write_text(
        f'#!/bin/sh\ncase " $* " in *" -o "*) echo build >> "{calls}";; esac\nexec "{real}" "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake, calls


def test_builds_once_per_cache_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("needs a C compiler")
    fake, calls = _logging_compiler(tmp_path, real)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert compile_library("memory_floor") is not None
    built = sorted((tmp_path / "cache" / "vtoken" / "kernels").glob("memory_floor_*.so"))
    assert len(built) == 1 and calls.read_text().split() == ["build"]
    library = compile_library("memory_floor")
    assert library is not None and hasattr(library.handle, "vtoken_floor")
    assert calls.read_text().split() == ["build"]  # loaded from the cache


def test_without_a_working_compiler_there_is_no_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert compile_library("repack") is None


def test_compiler_without_openmp_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A compiler that rejects -fopenmp gives a single-threaded library, and later loads do
    not try the OpenMP build again."""
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("needs a C compiler")
    # The OpenMP runtimes mapped into this process depend on what earlier tests loaded;
    # pin them to GNU's alone, the case where the OpenMP build is tried.
    monkeypatch.setattr(cbuild, "openmp_runtimes", lambda: {"/lib/libgomp.so.1"})
    calls = tmp_path / "calls"
    fake = tmp_path / "cc"
    fake.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -fopenmp "*) echo openmp >> "{calls}"; exit 1;; esac\n'
        f'exec "{real}" "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        for _ in range(2):
            repack_cpu.load_library.cache_clear()
            library = repack_cpu.load_library()
            assert library is not None and not library.threads
        assert calls.read_text().split() == ["openmp"]
        layout, block_size, kv_heads, head_dim = KVLayout.CPU_ATTN, 16, 1, 32
        cache = layout.new_cache(3, block_size, kv_heads, head_dim).normal_()
        expected = cache.clone()
        src, dst = torch.tensor([33, 40]), torch.tensor([1, 2])
        reference_repack([expected], src, dst, layout)
        parts = layout.part_strides(cache)
        assert parts is not None
        sizes = (block_size, kv_heads, head_dim)
        assert repack_cpu.cpu_repack([cache], src, dst, parts, *sizes, num_threads=2) == 1
        assert torch.equal(cache, expected)
    finally:
        repack_cpu.load_library.cache_clear()
