"""Build the C files of ``kernels/csrc`` once per machine and load them through ctypes.

``compile_library(name)`` compiles ``kernels/csrc/<name>.c`` with the system C compiler
(``$CC``, else ``cc``, else ``gcc``; ``-O3 -shared -fPIC``) on first use and caches the
library by content (source text, platform, compiler path, flags) under
``$XDG_CACHE_HOME/vtoken/kernels`` (default ``~/.cache/vtoken/kernels``); later loads, in
any process, reuse it. Without a working compiler it returns ``None`` and the callers fall
back to torch.

OpenMP: a library is built with ``-fopenmp`` only when torch's own OpenMP runtime (GNU
``libgomp.so.1``) is the one loaded and the compiler is GCC: the dynamic loader then binds
the library to that same runtime, so its team is torch's intra-op pool. Separate threads
would compete with torch's, which spin a while after every op: on the 2-core development VM
a pthread helper made the repack slower. If the OpenMP build fails, a plain one is used,
and the failure is remembered so that later loads do not try it again.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"

_OPENMP_RUNTIME = re.compile(r"^lib(gomp|omp|iomp5)([-.][^/]*)?\.so(\.\d+)*$")


@dataclass(frozen=True, slots=True)
class CLibrary:
    """A loaded library of ``kernels/csrc``."""

    handle: ctypes.CDLL
    threads: bool  # built with OpenMP on torch's runtime: work may use torch's pool


def openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return set()
    return {path for path in paths if _OPENMP_RUNTIME.match(os.path.basename(path))}


def _is_gcc(compiler: str) -> bool:
    """GCC's ``-fopenmp`` links ``libgomp.so.1``; clang's links LLVM's ``libomp``."""
    try:
        banner = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    banner = banner.lower()
    return "clang" not in banner and "free software foundation" in banner


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$XDG_CACHE_HOME/vtoken/kernels``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vtoken" / "kernels"


def _build(compiler: str, flags: list[str], source: Path, library: Path) -> None:
    """Compile ``source`` into ``library`` (atomic: concurrent workers may race to build)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        command = [compiler, "-O3", "-shared", "-fPIC", *flags, "-o", str(built), str(source)]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(built, library)


def compile_library(name: str) -> CLibrary | None:
    """Build ``kernels/csrc/<name>.c`` (cached, see the module docstring) and load it;
    ``None`` without a working compiler.

    Built with ``-fopenmp`` only when that binds it to torch's own runtime: GNU ``libgomp``,
    the one OpenMP runtime loaded, and GCC (clang would bring LLVM's ``libomp`` as a second
    one). ``threads`` is true when it was, and loading it mapped no other runtime.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = CSRC / f"{name}.c"
    text = source.read_text(encoding="utf-8")
    runtimes = openmp_runtimes()
    shared = [os.path.basename(path) for path in runtimes] == ["libgomp.so.1"]
    options = [["-fopenmp"], []] if shared and _is_gcc(compiler) else [[]]
    for flags in options:
        key = text + sys.platform + os.path.realpath(compiler) + " ".join(flags)
        library = cache_dir() / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        # A compiler without OpenMP fails the same way every time: try that build once.
        failed = library.with_suffix(".failed")
        if flags and failed.exists():
            continue
        try:
            if not library.exists():
                _build(compiler, flags, source, library)
            handle = ctypes.CDLL(str(library))
        except subprocess.CalledProcessError:
            if flags:
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.touch()
            continue
        except (OSError, subprocess.SubprocessError):
            continue
        # Threads only if loading it mapped no runtime of its own.
        return CLibrary(handle, bool(flags) and openmp_runtimes() == runtimes)
    return None
