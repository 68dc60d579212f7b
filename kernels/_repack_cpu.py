"""CPU repack: a tiny C loop compiled once with the system C compiler, called via ctypes.

Why not pure torch: torch's index kernels cost about 1 ns per element, and the CPU_ATTN
layout stores K transposed per (block, head) (``[head_dim, block_size]``), so every K
element of a moved token is its own index, in its own channel row.

How the C loop is ordered (per call, shared by all layers):

- moves are grouped by (src block, dst block) pair: the planner pairs ascending holes with
  ascending sources, so consecutive moves mostly share a pair; within a group, runs of
  consecutive src offsets -> consecutive dst offsets are merged;
- K (``offset_stride == 1``): the (block, head) K region is a contiguous matrix of
  ``block_size * elem_size``-byte rows. A *tile* is 64 bytes of it (64 / row_bytes whole
  rows) or one row. Every tile of a group moves the same bytes, so the group is compiled once
  into *passes* (a 64-byte dst chunk fed from one 64-byte src chunk: byte permutation, load
  mask, store mask), and each layer / head / tile is ``load, vpermb, masked store`` per pass
  (AVX-512 VBMI, checked at run time). Without it, a scalar loop copies, per channel row,
  every run of the pair while the row is in cache (``simd=False`` forces it);
- V (``[block_size, head_dim]`` rows) and the flash layout: a run of tokens is one
  contiguous copy per head (flash: for all heads);
- a software prefetch of exactly the lines each moved token touches, 4 moves ahead of the
  copy (``prefetch=False`` turns it off): on the development VM this beat prefetching whole
  blocks several groups ahead by 1.4-2x on cold SmolLM2 bs16 compaction;
- layers are claimed one at a time by the calling thread and by ``num_threads - 1`` detached
  helpers; a helper that starts late finds nothing left, so a busy core does not hold up the
  call.

Measured rates are in ``bench/RESULTS.md`` (``vtoken bench repack``).

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
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* Moves are grouped by (src block, dst block) pair (consecutive moves of one pair, as the
   planner emits them: ascending holes paired with ascending sources) and split into runs of
   consecutive src offsets -> consecutive dst offsets. */
typedef struct {
    int64_t src_block, dst_block, first_run, num_runs, first_pass, num_passes, first_move;
} group_t;
typedef struct { int64_t src_off, dst_off, len; } run_t;

/* Transposed K of one (block, head) is a contiguous [head_dim, block_size] matrix of R-byte
   rows. A tile is T bytes of it: 64 / R whole rows when R divides 64, else one row. Every
   tile of a group moves the same bytes, so a pass (one 64-byte dst chunk fed from one
   64-byte src chunk of the tile) is a byte permutation + mask, built once per call and
   applied to every tile of every head of every layer: load, vpermb, masked store. */
typedef struct {
    uint8_t idx[64];
    uint64_t mask, load_mask;
    int64_t dst_off, src_off;
} pass_t;

typedef struct {
    char **layers;
    const group_t *groups;
    const run_t *runs;
    const pass_t *passes;          /* NULL: scalar K rows */
    int64_t num_groups, block_size, kv_heads, head_dim, elem_size;
    int64_t tile_bytes, tiles;     /* K tiles per (block, head) for the pass path */
    const int64_t *parts;          /* [2][5]: base, block, offset, head, dim (elements) */
    int64_t num_layers;
    const int64_t *src, *dst;      /* the moves, for the prefetch */
    int64_t num_moves;
    int prefetch;
    /* Layers are claimed one at a time, so a thread that starts late (the other core busy)
       leaves its share to the others instead of holding up the call. */
    int64_t next_layer, layers_done; /* atomic */
    int refs;                        /* atomic: owners of this heap block */
    void *owned[3];                  /* freed with the job by its last owner */
} job_t;

static void release(job_t *j) {
    if (__atomic_sub_fetch(&j->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        for (int i = 0; i < 3; ++i) free(j->owned[i]);
        free(j);
    }
}

#define ROW_RUNS(T)                                                                  \
    do {                                                                             \
        for (int64_t d = 0; d < hd; ++d) {                                           \
            T *t = (T *)dp + d * ds; const T *s = (const T *)sp + d * ds;            \
            for (int64_t r = 0; r < nr; ++r) {                                       \
                const run_t *u = rs + r;                                             \
                T *tt = t + u->dst_off; const T *ss = s + u->src_off;                \
                if (u->len * (int64_t)sizeof(T) > 64) {                              \
                    memcpy(tt, ss, (size_t)u->len * sizeof(T)); continue;            \
                }                                                                    \
                for (int64_t k = 0; k < u->len; ++k) tt[k] = ss[k];                  \
            }                                                                        \
        }                                                                            \
    } while (0)

#define ELEMS(T)                                                                     \
    do {                                                                             \
        for (int64_t r = 0; r < nr; ++r)                                             \
            for (int64_t k = 0; k < rs[r].len; ++k) {                                \
                T *t = (T *)dp + (rs[r].dst_off + k) * os;                           \
                const T *s = (const T *)sp + (rs[r].src_off + k) * os;               \
                for (int64_t d = 0; d < hd; ++d) t[d * ds] = s[d * ds];              \
            }                                                                        \
    } while (0)

#if HAVE_X86
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static void apply_passes(const job_t *j, char *dst, const char *src, const group_t *g) {
    const pass_t *p = j->passes + g->first_pass;
    const int64_t tb = j->tile_bytes, tiles = j->tiles;
    for (int64_t i = 0; i < g->num_passes; ++i, ++p) {
        const __m512i idx = _mm512_loadu_si512((const void *)p->idx);
        const __mmask64 lm = p->load_mask, sm = p->mask;
        const char *s = src + p->src_off;
        char *d = dst + p->dst_off;
        for (int64_t t = 0; t < tiles; ++t, s += tb, d += tb)
            _mm512_mask_storeu_epi8(
                d, sm, _mm512_permutexvar_epi8(idx, _mm512_maskz_loadu_epi8(lm, s)));
    }
}

/* V runs: n contiguous bytes (n >= 1), no call overhead for the short runs of a compaction. */
__attribute__((target("avx512f,avx512bw")))
static void copy_bytes(char *d, const char *s, int64_t n) {
    for (; n >= 64; n -= 64, d += 64, s += 64)
        _mm512_storeu_si512((void *)d, _mm512_loadu_si512((const void *)s));
    if (n) {
        const __mmask64 m = (1ULL << n) - 1;
        _mm512_mask_storeu_epi8(d, m, _mm512_maskz_loadu_epi8(m, s));
    }
}
#else
static void apply_passes(const job_t *j, char *dst, const char *src, const group_t *g) {
    (void)j; (void)dst; (void)src; (void)g;
}
static void copy_bytes(char *d, const char *s, int64_t n) { memcpy(d, s, (size_t)n); }
#endif

/* One part (K or V) of one group in one layer, all heads. */
static void copy_part(const job_t *j, char *cache, const int64_t *p, const group_t *g) {
    const int64_t es = j->elem_size, hd = j->head_dim, os = p[2], hs = p[3], ds = p[4];
    const run_t *rs = j->runs + g->first_run;
    const int64_t nr = g->num_runs;
    char *dst_block = cache + (p[0] + g->dst_block * p[1]) * es;
    const char *src_block = cache + (p[0] + g->src_block * p[1]) * es;
    /* Tokens whose heads are contiguous (flash): a run is one memcpy for all heads. */
    if (ds == 1 && hs == hd && os == j->kv_heads * hd) {
        for (int64_t r = 0; r < nr; ++r)
            memcpy(dst_block + rs[r].dst_off * os * es, src_block + rs[r].src_off * os * es,
                   (size_t)(rs[r].len * os * es));
        return;
    }
    for (int64_t h = 0; h < j->kv_heads; ++h) {
        char *dp = dst_block + h * hs * es;
        const char *sp = src_block + h * hs * es;
        if (os == 1 && j->passes) {
            apply_passes(j, dp, sp, g);
        } else if (os == 1) {  /* transposed K: per channel row, every run of the pair */
            switch (es) {
                case 1: ROW_RUNS(uint8_t); break;
                case 2: ROW_RUNS(uint16_t); break;
                case 4: ROW_RUNS(uint32_t); break;
                default: ROW_RUNS(uint64_t); break;
            }
        } else if (ds == 1 && os == hd && j->passes) {  /* V rows: a run is contiguous */
            for (int64_t r = 0; r < nr; ++r)
                copy_bytes(dp + rs[r].dst_off * os * es, sp + rs[r].src_off * os * es,
                           rs[r].len * hd * es);
        } else if (ds == 1 && os == hd) {
            for (int64_t r = 0; r < nr; ++r)
                memcpy(dp + rs[r].dst_off * os * es, sp + rs[r].src_off * os * es,
                       (size_t)(rs[r].len * hd * es));
        } else if (ds == 1) {
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t k = 0; k < rs[r].len; ++k)
                    memcpy(dp + (rs[r].dst_off + k) * os * es, sp + (rs[r].src_off + k) * os * es,
                           (size_t)(hd * es));
        } else {
            switch (es) {
                case 1: ELEMS(uint8_t); break;
                case 2: ELEMS(uint16_t); break;
                case 4: ELEMS(uint32_t); break;
                default: ELEMS(uint64_t); break;
            }
        }
    }
}

/* Software prefetch of exactly the lines one moved token touches (K: one per channel row
   of each head, V: its row), PREFETCH_MOVES moves ahead of the copy: a cpu_attn (block, head)
   row is a page or less, where the hardware prefetchers stop, and groups jump between
   blocks. Measured on the development VM, this per-move distance keeps more misses in flight
   than prefetching whole blocks several groups ahead. */
#define PREFETCH_MOVES 4
static void prefetch_token(const job_t *j, const char *cache, const int64_t *p, int64_t slot,
                           int write) {
    const int64_t es = j->elem_size, bs = j->block_size;
    const char *start = cache + (p[0] + (slot / bs) * p[1] + (slot % bs) * p[2]) * es;
    const int64_t step = p[4] * es >= 64 ? p[4] * es : 64;
    const int64_t span = ((j->head_dim - 1) * p[4] + 1) * es;
    for (int64_t h = 0; h < j->kv_heads; ++h, start += p[3] * es)
        for (int64_t b = 0; b < span; b += step) {
            if (write) __builtin_prefetch(start + b, 1, 3);
            else __builtin_prefetch(start + b, 0, 3);
        }
}

static void prefetch_move(const job_t *j, const char *cache, int64_t m) {
    for (int part = 0; part < 2; ++part) {
        prefetch_token(j, cache, j->parts + 5 * part, j->src[m], 0);
        prefetch_token(j, cache, j->parts + 5 * part, j->dst[m], 1);
    }
}

static void *run_job(void *arg) {
    const job_t *j = (const job_t *)arg;
    job_t *jw = (job_t *)arg;
    for (;;) {
        const int64_t l = __atomic_fetch_add(&jw->next_layer, 1, __ATOMIC_RELAXED);
        if (l >= j->num_layers) break;
        char *cache = j->layers[l];
        int64_t ahead = 0; /* moves prefetched so far */
        for (int64_t g = 0; g < j->num_groups; ++g) {
            const group_t *cur = j->groups + g;
            if (j->prefetch) {
                const int64_t until = g + 1 < j->num_groups ? cur[1].first_move : j->num_moves;
                for (; ahead < until + PREFETCH_MOVES && ahead < j->num_moves; ++ahead)
                    prefetch_move(j, cache, ahead);
            }
            copy_part(j, cache, j->parts, cur);
            copy_part(j, cache, j->parts + 5, cur);
        }
        __atomic_fetch_add(&jw->layers_done, 1, __ATOMIC_RELEASE);
    }
    return 0;
}

static void *worker(void *arg) {
    run_job(arg);
    release((job_t *)arg);
    return 0;
}

static int simd_available(void) {
#if HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi");
#else
    return 0;
#endif
}

#define MAX_CHUNKS 16 /* tiles up to 1 KiB */

/* Passes of every group; NULL when out of memory. */
static pass_t *build_passes(group_t *groups, int64_t ng, const run_t *runs, int64_t es,
                            int64_t row_bytes, int64_t rows_per_tile, int64_t tile_bytes) {
    const int64_t nch = (tile_bytes + 63) / 64;
    int64_t cap = 64, np = 0;
    pass_t *passes = (pass_t *)malloc((size_t)cap * sizeof(pass_t));
    if (!passes) return 0;
    int slot[MAX_CHUNKS * MAX_CHUNKS];
    for (int64_t gi = 0; gi < ng; ++gi) {
        group_t *g = groups + gi;
        g->first_pass = np;
        for (int64_t i = 0; i < nch * nch; ++i) slot[i] = -1;
        for (int64_t r = 0; r < g->num_runs; ++r) {
            const run_t *u = runs + g->first_run + r;
            for (int64_t k = 0; k < u->len; ++k)
                for (int64_t row = 0; row < rows_per_tile; ++row)
                    for (int64_t e = 0; e < es; ++e) {
                        const int64_t db = row * row_bytes + (u->dst_off + k) * es + e;
                        const int64_t sb = row * row_bytes + (u->src_off + k) * es + e;
                        const int64_t key = (db >> 6) * nch + (sb >> 6);
                        if (slot[key] < 0) {
                            if (np == cap) {
                                const size_t bytes = (size_t)(2 * cap) * sizeof(pass_t);
                                pass_t *more = (pass_t *)realloc(passes, bytes);
                                if (!more) { free(passes); return 0; }
                                passes = more;
                                cap *= 2;
                            }
                            pass_t *p = passes + np;
                            memset(p, 0, sizeof(pass_t));
                            p->dst_off = (db >> 6) * 64;
                            p->src_off = (sb >> 6) * 64;
                            const int64_t valid = tile_bytes - p->src_off;
                            p->load_mask = valid >= 64 ? ~0ULL : ((1ULL << valid) - 1);
                            slot[key] = (int)(np - g->first_pass);
                            ++np;
                        }
                        pass_t *p = passes + g->first_pass + slot[key];
                        p->idx[db & 63] = (uint8_t)(sb & 63);
                        p->mask |= 1ULL << (db & 63);
                    }
        }
        g->num_passes = np - g->first_pass;
    }
    return passes;
}

/* options: bit 0 disables the SIMD K path, bit 1 the software prefetch. Returns 0, or -1
   when out of memory (nothing was copied). */
int vtoken_repack(char **layers, int64_t num_layers, const int64_t *src, const int64_t *dst,
                  int64_t num_moves, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                  int64_t elem_size, const int64_t *parts, int64_t num_threads, int64_t options) {
    if (num_moves <= 0 || num_layers <= 0) return 0;
    group_t *groups = (group_t *)malloc((size_t)num_moves * sizeof(group_t));
    run_t *runs = (run_t *)malloc((size_t)num_moves * sizeof(run_t));
    if (!groups || !runs) { free(groups); free(runs); return -1; }
    int64_t ng = 0, nr = 0;
    for (int64_t m = 0; m < num_moves; ++m) {
        const int64_t sb = src[m] / block_size, so = src[m] % block_size;
        const int64_t db = dst[m] / block_size, dof = dst[m] % block_size;
        if (ng == 0 || groups[ng - 1].src_block != sb || groups[ng - 1].dst_block != db) {
            group_t g = {sb, db, nr, 0, 0, 0, m};
            groups[ng++] = g;
        } else {
            run_t *last = runs + nr - 1;
            if (last->src_off + last->len == so && last->dst_off + last->len == dof) {
                last->len++;
                continue;
            }
        }
        run_t r = {so, dof, 1};
        runs[nr++] = r;
        groups[ng - 1].num_runs++;
    }
    /* The pass path needs K rows of one (block, head) contiguous: offset stride 1 and
       dim stride block_size. */
    const int64_t row_bytes = block_size * elem_size;
    int64_t rows_per_tile = 1;
    if (row_bytes < 64 && 64 % row_bytes == 0 && head_dim % (64 / row_bytes) == 0)
        rows_per_tile = 64 / row_bytes;
    const int64_t tile_bytes = rows_per_tile * row_bytes;
    pass_t *passes = 0;
    if (!(options & 1) && parts[2] == 1 && parts[4] == block_size &&
        tile_bytes <= 64 * MAX_CHUNKS && simd_available())
        passes = build_passes(groups, ng, runs, elem_size, row_bytes, rows_per_tile, tile_bytes);
    job_t *job = (job_t *)calloc(1, sizeof(job_t));
    if (!job) { free(passes); free(groups); free(runs); return -1; }
    job_t j = {layers, groups, runs, passes, ng, block_size, kv_heads, head_dim, elem_size,
               tile_bytes, head_dim / rows_per_tile, parts, num_layers, src, dst, num_moves,
               !(options & 2),
               0, 0, 1, {passes, groups, runs}};
    *job = j;
    if (num_threads > num_layers) num_threads = num_layers;
    if (num_threads > 64) num_threads = 64;
    for (int64_t t = 1; t < num_threads; ++t) {
        pthread_t thread;
        __atomic_add_fetch(&job->refs, 1, __ATOMIC_ACQ_REL);
        if (pthread_create(&thread, 0, worker, job)) {
            __atomic_sub_fetch(&job->refs, 1, __ATOMIC_ACQ_REL);
            break;
        }
        pthread_detach(thread);
    }
    run_job(job);
    /* Only layers another thread has claimed are waited for. */
    while (__atomic_load_n(&job->layers_done, __ATOMIC_ACQUIRE) < num_layers) sched_yield();
    release(job);
    return 0;
}
"""

# Below this many moved bytes a second thread costs more (about 50 us to start) than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20
_MAX_THREADS = 8


def default_threads(moved_bytes: int) -> int:
    """Threads for a repack of ``moved_bytes``: ``VTOKEN_REPACK_THREADS`` if set, else 1 on
    machines of 2 CPUs or fewer, else up to torch's thread count, one per MiB moved, <= 8.

    Measured on the 2-core shared development VM: a second thread took SmolLM2 bs16
    compaction from 5.3 to 2.9 ms when the other core was idle, and made the median worse
    (5.9 -> 8.4 ms) under load average 4-7 from other sessions.
    """
    forced = os.environ.get("VTOKEN_REPACK_THREADS")
    if forced:
        return max(1, int(forced))
    if (os.cpu_count() or 1) <= 2:
        return 1
    by_size = max(1, moved_bytes // _MIN_BYTES_PER_THREAD)
    return max(1, min(torch.get_num_threads(), by_size, _MAX_THREADS))


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
    handle.vtoken_repack.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
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
    simd: bool = True,
    prefetch: bool = True,
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
        num_threads = default_threads(moved_bytes)
    pointers = (ctypes.c_void_p * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
    strides = [value for part in parts for value in dataclasses.astuple(part)]
    packed = (ctypes.c_int64 * 10)(*strides)
    status = library.vtoken_repack(
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
        (0 if simd else 1) | (0 if prefetch else 2),
    )
    return status == 0
