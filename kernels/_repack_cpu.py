"""CPU repack: a tiny C loop compiled once with the system C compiler, called via ctypes.

Why not pure torch: on the 2-core development machine (bf16, SmolLM2 shape, compaction of
a 4096-token request after evicting 50%, 1043 moves x 30 layers, 24 MB moved) a plain
contiguous copy of the moved bytes runs at 44 GB/s; torch advanced indexing reaches
0.024x of that, flat ``index_select``/``index_copy_`` with precomputed element offsets
0.024x, and even the contiguous V rows alone move at 0.054x: torch's index kernels cost
about 1 ns per element, and K is stored transposed, so every K element is its own index.
The C loop below walks moves in planner order (ascending source and destination), so the
lines of a transposed K block stay in L1 across consecutive moves; see ``bench/repack.py``
and ``bench/RESULTS.md`` for its rates.

No torch headers: the source compiles in about 0.3 s, without the minute a
``torch.utils.cpp_extension`` build takes. Without a C compiler ``load_library`` returns
``None`` and the dispatcher falls back to torch indexing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from kernels.layout import PartStrides

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char **layers;             /* [num_layers] base pointers */
    int64_t num_layers;
    const int64_t *src, *dst;  /* [num_moves] global slots */
    int64_t num_moves, block_size, kv_heads, head_dim, elem_size;
    const int64_t *parts;      /* [2][5]: base, block, offset, head, dim (elements) */
    int64_t first_item, num_items; /* work items = layers */
} job_t;

#define STRIDED_COPY(T)                                                      \
    do {                                                                     \
        T *d = (T *)dp; const T *s = (const T *)sp;                          \
        for (int64_t i = 0; i < j->head_dim; ++i) d[i * ds] = s[i * ds];    \
    } while (0)

static void copy_token(const job_t *j, char *cache, const int64_t *p, int64_t src, int64_t dst) {
    const int64_t es = j->elem_size, ds = p[4], bs = j->block_size;
    /* One memcpy per token when the heads of a token are contiguous (flash layout). */
    const int whole_token = ds == 1 && p[3] == j->head_dim;
    const int64_t heads = whole_token ? 1 : j->kv_heads;
    const size_t row_bytes = (size_t)(whole_token ? j->kv_heads * j->head_dim : j->head_dim) * es;
    const int64_t so = p[0] + (src / bs) * p[1] + (src % bs) * p[2];
    const int64_t dof = p[0] + (dst / bs) * p[1] + (dst % bs) * p[2];
    for (int64_t h = 0; h < heads; ++h) {
        char *dp = cache + (dof + h * p[3]) * es;
        const char *sp = cache + (so + h * p[3]) * es;
        if (ds == 1) { memcpy(dp, sp, row_bytes); continue; }
        switch (es) {
            case 1: STRIDED_COPY(uint8_t); break;
            case 2: STRIDED_COPY(uint16_t); break;
            case 4: STRIDED_COPY(uint32_t); break;
            default: STRIDED_COPY(uint64_t); break;
        }
    }
}

/* Issue loads for one token's K or V lines ahead of use: the strided K column of a
   transposed block misses on every line, and a scalar loop alone keeps few misses in flight. */
static void prefetch_token(const job_t *j, const char *cache, const int64_t *p, int64_t slot,
                           int write) {
    const int64_t es = j->elem_size, bs = j->block_size;
    const int64_t start = p[0] + (slot / bs) * p[1] + (slot % bs) * p[2];
    const int64_t step = p[4] * es >= 64 ? p[4] : (64 / es > 0 ? 64 / es : 1);
    const int64_t span = (j->head_dim - 1) * p[4] + 1;
    for (int64_t h = 0; h < j->kv_heads; ++h) {
        const char *base = cache + (start + h * p[3]) * es;
        for (int64_t e = 0; e < span; e += step) {
            if (write) __builtin_prefetch(base + e * es, 1, 3);
            else __builtin_prefetch(base + e * es, 0, 3);
        }
    }
}

/* Moves outer, heads and K/V inner: in cpu_attn the K and V of one (block, head) are one
   contiguous row, so a move touches a few rows of its source and destination blocks, and
   the planner's ascending order keeps those blocks in L1 across consecutive moves. */
#define PREFETCH_DISTANCE 4
static void copy_item(const job_t *j, int64_t layer) {
    char *cache = j->layers[layer];
    for (int64_t m = 0; m < j->num_moves; ++m) {
        if (m + PREFETCH_DISTANCE < j->num_moves) {
            const int64_t ahead = m + PREFETCH_DISTANCE;
            for (int part = 0; part < 2; ++part) {
                prefetch_token(j, cache, j->parts + 5 * part, j->src[ahead], 0);
                prefetch_token(j, cache, j->parts + 5 * part, j->dst[ahead], 1);
            }
        }
        copy_token(j, cache, j->parts, j->src[m], j->dst[m]);
        copy_token(j, cache, j->parts + 5, j->src[m], j->dst[m]);
    }
}

static void *run_job(void *arg) {
    const job_t *j = (const job_t *)arg;
    for (int64_t i = 0; i < j->num_items; ++i) copy_item(j, j->first_item + i);
    return 0;
}

int vtoken_repack(char **layers, int64_t num_layers, const int64_t *src, const int64_t *dst,
                  int64_t num_moves, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                  int64_t elem_size, const int64_t *parts, int64_t num_threads) {
    job_t jobs[64];
    pthread_t threads[64];
    const int64_t items = num_layers;
    if (num_threads > items) num_threads = items;
    if (num_threads > 64) num_threads = 64;
    if (num_threads < 1) num_threads = 1;
    for (int64_t t = 0; t < num_threads; ++t) {
        job_t j = {layers, num_layers, src, dst, num_moves, block_size, kv_heads, head_dim,
                   elem_size, parts, items * t / num_threads,
                   items * (t + 1) / num_threads - items * t / num_threads};
        jobs[t] = j;
    }
    int64_t started = 0;
    for (int64_t t = 1; t < num_threads; ++t, ++started)
        if (pthread_create(&threads[t], 0, run_job, &jobs[t])) break;
    run_job(&jobs[0]);
    for (int64_t t = started + 1; t < num_threads; ++t) run_job(&jobs[t]);
    for (int64_t t = 1; t <= started; ++t) pthread_join(threads[t], 0);
    return 0;
}
"""

# Below this many moved bytes a second thread costs more (about 50 us to start) than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vtoken" / "kernels"


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled repack library, built on first use; ``None`` without a C compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256((_SOURCE + sys.platform).encode()).hexdigest()[:16]
    library = _cache_dir() / f"repack_{digest}.so"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
                source = Path(tmp) / "repack.c"
                source.write_text(_SOURCE)
                built = Path(tmp) / "repack.so"
                command = [
                    compiler,
                    "-O3",
                    "-shared",
                    "-fPIC",
                    "-pthread",
                    "-o",
                    str(built),
                    str(source),
                ]
                subprocess.run(command, check=True, capture_output=True, timeout=120)
                os.replace(built, library)  # atomic: concurrent workers may race to build
        handle = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError):
        return None
    handle.vtoken_repack.restype = ctypes.c_int
    handle.vtoken_repack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    handle.vtoken_repack.argtypes += [ctypes.c_void_p] + [ctypes.c_int64] * 5
    handle.vtoken_repack.argtypes += [ctypes.c_void_p, ctypes.c_int64]
    return handle


def cpu_repack(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    parts: tuple[PartStrides, PartStrides],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    num_threads: int | None = None,
) -> bool:
    """Move slots in every layer with the C loop; ``False`` when the library is unavailable.

    ``src_slots``/``dst_slots``: contiguous int64 CPU ``[num_moves]``; caches: contiguous,
    one dtype, checked by the caller.
    """
    library = load_library()
    if library is None:
        return False
    num_moves = src_slots.numel()
    elem_size = kv_caches[0].element_size()
    moved_bytes = num_moves * len(kv_caches) * 2 * kv_heads * head_dim * elem_size
    if num_threads is None:
        num_threads = max(1, min(torch.get_num_threads(), moved_bytes // _MIN_BYTES_PER_THREAD))
    pointers = (ctypes.c_void_p * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
    strides = [value for part in parts for value in dataclasses.astuple(part)]
    packed = (ctypes.c_int64 * 10)(*strides)
    library.vtoken_repack(
        pointers,
        len(kv_caches),
        src_slots.data_ptr(),
        dst_slots.data_ptr(),
        num_moves,
        block_size,
        kv_heads,
        head_dim,
        elem_size,
        packed,
        num_threads,
    )
    return True
