/* CPU repack: move KV slots in every layer (kernels/repack_cpu.py loads it through ctypes).

   Why C and not torch: torch's index kernels cost about 1 ns per element, and the CPU_ATTN
   layout stores K transposed per (block, head) ([head_dim, block_size]), so every K element
   of a moved token is its own index, in its own channel row. No torch headers: the file
   compiles in about 0.3 s (kernels/cbuild.py), without the minute a
   torch.utils.cpp_extension build takes.

   How the loop is ordered (per call, shared by all layers):

   - moves are grouped by destination block: the planner pairs ascending holes with
     ascending sources, so consecutive moves mostly share one; within a group, runs of
     consecutive src offsets of one source block -> consecutive dst offsets are merged;
   - the work is a sequence of units (layer, group, head); a unit copies that head's K and V
     for every run of the group;
   - K (offset stride 1): the (block, head) K region is a contiguous matrix of
     block_size * elem_size-byte rows. A tile is 64 bytes of it (64 / row_bytes whole rows)
     or one row. Every tile of a group moves the same bytes, so the group is compiled once
     into passes (a 64-byte dst chunk fed from one 64-byte chunk of one source block: byte
     permutation, load mask, store mask). Per tile, the passes of one dst chunk are merged
     in a register (load, masked vpermb each) and stored once (AVX-512 VBMI, checked at run
     time): a destination block filled from five source blocks is written once per tile,
     not five times. Without VBMI, a scalar loop copies, per channel row, every run of the
     group while the row is in cache (option bit 0 forces it);
   - V ([block_size, head_dim] rows) and the flash layout: a run of tokens is one contiguous
     copy per head (flash: one unit per group, all heads at once). When V rows are whole
     64-byte aligned lines (head_dim * elem_size % 64 == 0, aligned caches), they are stored
     non-temporally: a plain store reads every line it writes first, and in a compaction
     those reads are about an eighth of all the lines read (6-19% faster compaction on the
     development VM, trickle unchanged);
   - the cache lines of every unit are listed once per call (the same offsets in every
     layer), and a prefetch cursor walks that list PREFETCH_LINES ahead of the copy, topped
     up every LINES_PER_TOP_UP lines copied so that a large unit is fed while it is copied
     (option bit 1 turns it off). Moving one token of transposed K reads or rewrites a line
     per channel row, in 2-32 KiB regions scattered over the pool, where the hardware
     prefetchers barely start: the copy is bound by misses in flight and by instructions
     per line, so the prefetch loop is a branch-free walk of an offset list;
   - layers are claimed one at a time by the threads of an OpenMP team (built with -fopenmp
     only when that team is torch's own intra-op pool, see kernels/cbuild.py): on the 2-core
     development VM the shared pool took SmolLM2 bs16 compaction from 4.5 to 2.5 ms on 2
     threads.

   Measured rates are in bench/RESULTS.md (vtoken bench repack). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* Moves are grouped by destination block (consecutive moves into one block, as the planner
   emits them: ascending holes paired with ascending sources) and split into runs of
   consecutive src offsets of one source block -> consecutive dst offsets. */
typedef struct {
    int64_t dst_block, first_run, num_runs, first_pass, num_passes, first_line, num_lines;
} group_t;
typedef struct { int64_t src_block, src_off, dst_off, len; } run_t;

/* Transposed K of one (block, head) is a contiguous [head_dim, block_size] matrix of R-byte
   rows. A tile is T bytes of it: 64 / R whole rows when R divides 64, else one row. Every
   tile of a group moves the same bytes, so a pass (one 64-byte dst chunk fed from one
   64-byte src chunk of one source block) is a byte permutation + mask, built once per call
   and applied to every tile of every head of every layer: the passes of one dst chunk are
   merged in a register (load, masked vpermb each) and stored once, under their union mask. */
typedef struct {
    uint8_t idx[64];
    uint64_t mask, load_mask;
    uint64_t store_mask;           /* on the last pass of a dst chunk: the chunk's union */
    int64_t dst_off;               /* dst chunk in the tile */
    int64_t src_rel;               /* src chunk, in bytes from the dst (block, head) base */
    int64_t last;                  /* the last pass of its dst chunk: store */
} pass_t;

typedef struct {
    char **layers;
    const group_t *groups;
    const run_t *runs;
    const pass_t *passes;          /* NULL: scalar K rows */
    const int64_t *lines;          /* per group: (offset << 1) | part, in bytes from the dst
                                      (block, head) base of that part (sources: negative too) */
    int64_t num_groups, block_size, kv_heads, head_dim, elem_size;
    int64_t tile_bytes, tiles;     /* K tiles per (block, head) for the pass path */
    const int64_t *parts;          /* [2][5]: base, block, offset, head, dim (elements) */
    int64_t num_layers;
    int64_t unit_heads;            /* heads per unit loop: 1 when a run covers all heads */
    int64_t distance;              /* prefetch distance in cache lines; 0: off */
    int64_t num_threads;           /* requested; the cursor crosses layers only when 1 */
    int64_t next_layer;            /* atomic: layers are claimed one at a time */
    int64_t threads_ran;           /* atomic: team members that ran */
    int64_t stream_values;         /* V rows are whole aligned lines: streamed (see
                                      stream_bytes), so the cursor skips their dst lines */
} job_t;

#define ROW_RUNS(T)                                                                  \
    do {                                                                             \
        for (int64_t d = 0; d < hd; ++d) {                                           \
            T *t = (T *)dp + d * ds;                                                 \
            for (int64_t r = 0; r < nr; ++r) {                                       \
                const run_t *u = rs + r;                                             \
                const T *s = (const T *)(dp + SRC_REL(u)) + d * ds;                  \
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
                const T *s = (const T *)(dp + SRC_REL(rs + r)) + (rs[r].src_off + k) * os; \
                for (int64_t d = 0; d < hd; ++d) t[d * ds] = s[d * ds];              \
            }                                                                        \
    } while (0)

#if HAVE_X86
/* Tile by tile (every pass of a tile while its lines are in L1). */
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static void apply_passes(const job_t *j, char *dst, const group_t *g, int64_t first,
                         int64_t tiles) {
    const pass_t *p = j->passes + g->first_pass;
    const int64_t tb = j->tile_bytes, np = g->num_passes;
    dst += first * tb;
    tiles -= first;
    if (np == 1) {
        const __m512i idx = _mm512_loadu_si512((const void *)p->idx);
        const __mmask64 lm = p->load_mask, sm = p->mask;
        const char *s = dst + p->src_rel;
        char *d = dst + p->dst_off;
        for (int64_t t = 0; t < tiles; ++t, s += tb, d += tb)
            _mm512_mask_storeu_epi8(
                d, sm, _mm512_permutexvar_epi8(idx, _mm512_maskz_loadu_epi8(lm, s)));
        return;
    }
    for (int64_t t = 0; t < tiles; ++t, dst += tb) {
        __m512i acc = _mm512_setzero_si512();
        for (int64_t i = 0; i < np; ++i) {
            const pass_t *q = p + i;
            acc = _mm512_mask_permutexvar_epi8(
                acc, q->mask, _mm512_loadu_si512((const void *)q->idx),
                _mm512_maskz_loadu_epi8(q->load_mask, dst + q->src_rel));
            if (q->last) {
                _mm512_mask_storeu_epi8(dst + q->dst_off, q->store_mask, acc);
                acc = _mm512_setzero_si512();
            }
        }
    }
}

/* V runs of whole, 64-byte aligned lines: non-temporal stores write the destination lines
   without reading them first (a plain store fetches every line it writes: in a compaction
   that is an eighth of all the lines read). The caller fences (sfence) before returning. */
__attribute__((target("avx512f")))
static void stream_bytes(char *d, const char *s, int64_t n) {
    for (; n > 0; n -= 64, d += 64, s += 64)
        _mm512_stream_si512((void *)d, _mm512_loadu_si512((const void *)s));
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
static void apply_passes(const job_t *j, char *dst, const group_t *g, int64_t first,
                         int64_t tiles) {
    (void)j; (void)dst; (void)g; (void)first; (void)tiles;
}
static void copy_bytes(char *d, const char *s, int64_t n) { memcpy(d, s, (size_t)n); }
static void stream_bytes(char *d, const char *s, int64_t n) { memcpy(d, s, (size_t)n); }
#endif

static int contiguous_heads(const job_t *j, const int64_t *p) {
    return p[4] == 1 && p[3] == j->head_dim && p[2] == j->kv_heads * j->head_dim;
}

/* Whether the rows of part p ([block_size, head_dim] per (block, head)) are whole 64-byte
   aligned lines in every layer. */
static int whole_lines(const job_t *j, const int64_t *p, char *const *layers) {
    const int64_t es = j->elem_size;
    if (p[4] != 1 || p[2] != j->head_dim || (j->head_dim * es) % 64) return 0;
    if ((p[0] * es) % 64 || (p[1] * es) % 64 || (p[3] * es) % 64) return 0;
    for (int64_t l = 0; l < j->num_layers; ++l)
        if ((uintptr_t)layers[l] % 64) return 0;
    return 1;
}

/* Where part p (K or V) of head h of a block starts. */
static char *part_base(const job_t *j, char *cache, const int64_t *p, int64_t block, int64_t h) {
    return cache + (p[0] + block * p[1] + h * p[3]) * j->elem_size;
}

/* One part (K or V) of one group, one head (all heads when the unit is all heads). */
static void copy_part(const job_t *j, char *cache, const int64_t *p, const group_t *g,
                      int64_t h) {
    const int64_t es = j->elem_size, hd = j->head_dim, os = p[2], ds = p[4];
    const run_t *rs = j->runs + g->first_run;
    const int64_t nr = g->num_runs;
    char *dp = part_base(j, cache, p, g->dst_block, h);
    /* A run's source (block, head), relative to the destination's: same strides. */
#define SRC_REL(u) (((u)->src_block - g->dst_block) * p[1] * es)
    if (j->unit_heads == 1 && contiguous_heads(j, p)) {  /* flash: one copy for all heads */
        for (int64_t r = 0; r < nr; ++r)
            memcpy(dp + rs[r].dst_off * os * es, dp + SRC_REL(rs + r) + rs[r].src_off * os * es,
                   (size_t)(rs[r].len * os * es));
    } else if (os == 1 && ds == j->block_size && j->passes) {
        apply_passes(j, dp, g, 0, j->tiles);
    } else if (os == 1) {  /* transposed K: per channel row, every run of the pair */
        switch (es) {
            case 1: ROW_RUNS(uint8_t); break;
            case 2: ROW_RUNS(uint16_t); break;
            case 4: ROW_RUNS(uint32_t); break;
            default: ROW_RUNS(uint64_t); break;
        }
    } else if (ds == 1 && os == hd) {  /* V rows: a run is contiguous */
        for (int64_t r = 0; r < nr; ++r) {
            char *d = dp + rs[r].dst_off * os * es;
            const char *from = dp + SRC_REL(rs + r) + rs[r].src_off * os * es;
            if (j->stream_values && p == j->parts + 5) stream_bytes(d, from, rs[r].len * hd * es);
            else if (j->passes) copy_bytes(d, from, rs[r].len * hd * es);  /* AVX-512 is there */
            else memcpy(d, from, (size_t)(rs[r].len * hd * es));
        }
    } else if (ds == 1) {
        for (int64_t r = 0; r < nr; ++r)
            for (int64_t k = 0; k < rs[r].len; ++k)
                memcpy(dp + (rs[r].dst_off + k) * os * es,
                       dp + SRC_REL(rs + r) + (rs[r].src_off + k) * os * es, (size_t)(hd * es));
    } else {
        switch (es) {
            case 1: ELEMS(uint8_t); break;
            case 2: ELEMS(uint16_t); break;
            case 4: ELEMS(uint32_t); break;
            default: ELEMS(uint64_t); break;
        }
    }
#undef SRC_REL
}

/* The prefetch cursor walks the same (layer, group, head) units as the copy, `distance`
   cache lines ahead of it: each unit first tops the cursor up to `distance` lines past its
   own last line, then copies. A (block, head) K region is 2-32 KiB, inside which the
   hardware prefetchers barely start, and consecutive units jump between blocks. */
typedef struct {
    const job_t *j;
    int64_t layer, last_layer, group, head, line;
    const char *base[2]; /* dst K, dst V (block, head) bases of the cursor's unit */
} cursor_t;

static void cursor_bases(cursor_t *c) {
    const job_t *j = c->j;
    const group_t *g = j->groups + c->group;
    char *cache = j->layers[c->layer];
    for (int part = 0; part < 2; ++part)
        c->base[part] = part_base(j, cache, j->parts + 5 * part, g->dst_block, c->head);
}

/* Advance past finished units; 0 when the cursor ran off its last layer. */
static int cursor_valid(cursor_t *c) {
    const job_t *j = c->j;
    if (c->layer > c->last_layer) return 0;
    while (c->line >= j->groups[c->group].num_lines) {
        c->line = 0;
        if (++c->head == j->unit_heads) {
            c->head = 0;
            if (++c->group == j->num_groups) {
                c->group = 0;
                if (++c->layer > c->last_layer) return 0;
            }
        }
        cursor_bases(c);
    }
    return 1;
}

/* Every line with the non-temporal read hint (prefetchnta), destinations too: each line is
   used once per call, and on the development VM this beat write intent (prefetchw) by 3-11%
   on SmolLM2 and was within 2% on llama8b; an L2 hint (prefetcht1) was 5-40% slower, and a
   per-line choice (write intent for destinations) no better than NTA for all. */
static void prefetch_lines(cursor_t *c, int64_t count) {
    while (count > 0 && cursor_valid(c)) {
        const group_t *g = c->j->groups + c->group;
        const int64_t *x = c->j->lines + g->first_line + c->line;
        int64_t n = g->num_lines - c->line;
        if (n > count) n = count;
        for (int64_t i = 0; i < n; ++i) __builtin_prefetch(c->base[x[i] & 1] + (x[i] >> 1), 0, 0);
        c->line += n;
        count -= n;
    }
}

/* Prefetch until `target` lines of the cursor's walk have been issued. */
static void top_up(const job_t *j, cursor_t *c, int64_t *issued, int64_t target) {
    if (j->distance && *issued < target) {
        prefetch_lines(c, target - *issued);
        *issued = target;
    }
}

/* Lines copied between two top-ups of the prefetch cursor: a unit of a large block (bs 128:
   hundreds of lines) is fed while it is copied, not in one burst before it. On the
   development VM 32 beat a fixed 8 tiles by 4-15% on bs 128 and trickle cases and cost
   up to 4% on SmolLM2 bs 16 compaction; 128 was 10-25% slower on bs 128 compaction. */
#define LINES_PER_TOP_UP 32

static void run_job(job_t *jw) {
    const job_t *j = jw;
    const int64_t *k = j->parts, tiles = j->tiles, ahead = j->distance;
    __atomic_fetch_add(&jw->threads_ran, 1, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t l = __atomic_fetch_add(&jw->next_layer, 1, __ATOMIC_RELAXED);
        if (l >= j->num_layers) break;
        char *cache = j->layers[l];
        /* One thread runs into the next layer; with several, another thread owns it. */
        const int64_t last = j->num_threads == 1 && l + 1 < j->num_layers ? l + 1 : l;
        cursor_t c = {j, l, last, 0, 0, 0, {0, 0}};
        cursor_bases(&c);
        int64_t issued = 0, consumed = 0;
        for (int64_t gi = 0; gi < j->num_groups; ++gi) {
            const group_t *g = j->groups + gi;
            for (int64_t h = 0; h < j->unit_heads; ++h) {
                const int64_t first_line = consumed, lines = g->num_lines;
                consumed += lines;
                if (k[2] == 1 && j->passes) {  /* K on the pass path, fed as it goes */
                    char *dk = part_base(j, cache, k, g->dst_block, h);
                    int64_t step = lines ? (LINES_PER_TOP_UP * tiles) / lines : tiles;
                    if (step < 1) step = 1;
                    for (int64_t t = 0; t < tiles; t += step) {
                        const int64_t end = t + step < tiles ? t + step : tiles;
                        top_up(j, &c, &issued, first_line + lines * end / tiles + ahead);
                        apply_passes(j, dk, g, t, end);
                    }
                } else {
                    top_up(j, &c, &issued, consumed + ahead);
                    copy_part(j, cache, k, g, h);
                }
                top_up(j, &c, &issued, consumed + ahead);
                copy_part(j, cache, k + 5, g, h);
            }
        }
    }
#if HAVE_X86
    _mm_sfence(); /* order the streamed stores before the team's barrier */
#endif
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

#define MAX_CHUNKS 16 /* the pass path takes tiles up to 16 chunks (1 KiB); longer K rows
                         take the scalar loop, whose setup does not grow with the row */

/* Passes of every group, ordered by dst chunk; NULL when out of memory. `block_bytes`: the
   K block stride in bytes. */
static pass_t *build_passes(group_t *groups, int64_t ng, const run_t *runs, int64_t es,
                            int64_t row_bytes, int64_t rows_per_tile, int64_t tile_bytes,
                            int64_t block_bytes) {
    int64_t cap = 64, np = 0;
    pass_t *passes = (pass_t *)malloc((size_t)cap * sizeof(pass_t));
    if (!passes) return 0;
    for (int64_t gi = 0; gi < ng; ++gi) {
        group_t *g = groups + gi;
        g->first_pass = np;
        int64_t hit = -1; /* the pass used last: consecutive bytes mostly share it */
        for (int64_t r = 0; r < g->num_runs; ++r) {
            const run_t *u = runs + g->first_run + r;
            const int64_t rel = (u->src_block - g->dst_block) * block_bytes;
            for (int64_t k = 0; k < u->len; ++k)
                for (int64_t row = 0; row < rows_per_tile; ++row)
                    for (int64_t e = 0; e < es; ++e) {
                        const int64_t db = row * row_bytes + (u->dst_off + k) * es + e;
                        const int64_t sb = row * row_bytes + (u->src_off + k) * es + e;
                        const int64_t dst_off = (db >> 6) * 64, src_rel = rel + (sb >> 6) * 64;
                        if (hit < 0 || passes[hit].dst_off != dst_off ||
                            passes[hit].src_rel != src_rel) {
                            for (hit = g->first_pass; hit < np; ++hit)
                                if (passes[hit].dst_off == dst_off &&
                                    passes[hit].src_rel == src_rel)
                                    break;
                        }
                        if (hit == np) {
                            if (np == cap) {
                                const size_t bytes = (size_t)(2 * cap) * sizeof(pass_t);
                                pass_t *more = (pass_t *)realloc(passes, bytes);
                                if (!more) { free(passes); return 0; }
                                passes = more;
                                cap *= 2;
                            }
                            pass_t *p = passes + np++;
                            memset(p, 0, sizeof(pass_t));
                            p->dst_off = dst_off;
                            p->src_rel = src_rel;
                            const int64_t valid = tile_bytes - (sb >> 6) * 64;
                            p->load_mask = valid >= 64 ? ~0ULL : ((1ULL << valid) - 1);
                        }
                        passes[hit].idx[db & 63] = (uint8_t)(sb & 63);
                        passes[hit].mask |= 1ULL << (db & 63);
                    }
        }
        g->num_passes = np - g->first_pass;
        /* Order by dst chunk (stable insertion sort: a group has few passes), then mark the
           last pass of each chunk with the chunk's union mask. */
        pass_t *first = passes + g->first_pass;
        for (int64_t i = 1; i < g->num_passes; ++i) {
            pass_t key = first[i];
            int64_t k = i - 1;
            for (; k >= 0 && first[k].dst_off > key.dst_off; --k) first[k + 1] = first[k];
            first[k + 1] = key;
        }
        uint64_t union_mask = 0;
        for (int64_t i = 0; i < g->num_passes; ++i) {
            union_mask |= first[i].mask;
            if (i + 1 == g->num_passes || first[i + 1].dst_off != first[i].dst_off) {
                first[i].last = 1;
                first[i].store_mask = union_mask;
                union_mask = 0;
            }
        }
    }
    return passes;
}

/* The cache lines of one unit, in the order the copy touches them. */
typedef struct { int64_t *items, count, cap, last[2]; } lines_t;

static int push_line(lines_t *s, int part, int64_t offset) {
    if (s->count == s->cap) {
        int64_t *more = (int64_t *)realloc(s->items, (size_t)(2 * s->cap) * sizeof(int64_t));
        if (!more) return -1;
        s->items = more;
        s->cap *= 2;
    }
    s->items[s->count++] = offset * 2 + part;
    return 0;
}

/* The lines of bytes [start, start + len), skipping one this side listed last. */
static int add_range(lines_t *s, int part, int side, int64_t start, int64_t len) {
    for (int64_t line = start >> 6; line <= (start + len - 1) >> 6; ++line) {
        if (s->last[side] == line) continue;
        if (push_line(s, part, line * 64)) return -1;
        s->last[side] = line;
    }
    return 0;
}

static int64_t *build_lines(const job_t *j, group_t *groups, const run_t *runs) {
    lines_t s = {(int64_t *)malloc(1024 * sizeof(int64_t)), 0, 1024, {-1, -1}};
    if (!s.items) return 0;
    const int64_t es = j->elem_size, hd = j->head_dim;
    for (int64_t gi = 0; gi < j->num_groups; ++gi) {
        group_t *g = groups + gi;
        g->first_line = s.count;
        for (int part = 0; part < 2; ++part) {
            const int64_t *p = j->parts + 5 * part, os = p[2], ds = p[4], block = p[1] * es;
            s.last[0] = s.last[1] = -1;
            const run_t *rs = runs + g->first_run;
            int rc = 0;
            const int all_heads = j->unit_heads == 1 && contiguous_heads(j, p);
            if (all_heads || (ds == 1 && os == hd)) {  /* a run is contiguous */
                const int64_t run_bytes = (all_heads ? os : hd) * es;
                for (int64_t r = 0; r < g->num_runs && !rc; ++r) {
                    const int64_t n = rs[r].len * run_bytes;
                    const int64_t rel = (rs[r].src_block - g->dst_block) * block;
                    const int streamed = part == 1 && j->stream_values;  /* not read */
                    rc = (streamed ? 0 : add_range(&s, part, 1, rs[r].dst_off * os * es, n)) |
                         add_range(&s, part, 0, rel + rs[r].src_off * os * es, n);
                }
            } else if (os == 1 && ds == j->block_size && j->passes) {  /* K tiles */
                /* Per tile: each dst chunk once, then each source chunk once. */
                const pass_t *q = j->passes + g->first_pass;
                const int64_t n = g->num_passes;
                int64_t *chunks = (int64_t *)malloc((size_t)(2 * n) * sizeof(int64_t));
                int64_t count = 0;
                if (!chunks) rc = -1;
                for (int64_t i = 0; i < n && !rc; ++i)
                    if (q[i].last) chunks[count++] = q[i].dst_off;
                for (int64_t i = 0; i < n && !rc; ++i) {
                    int64_t seen = 0;
                    while (seen < i && q[seen].src_rel != q[i].src_rel) ++seen;
                    if (seen == i) chunks[count++] = q[i].src_rel;
                }
                for (int64_t t = 0; t < j->tiles && !rc; ++t)
                    for (int64_t i = 0; i < count && !rc; ++i)
                        rc = push_line(&s, part, t * j->tile_bytes + chunks[i]);
                free(chunks);
            } else if (os == 1) {  /* transposed K: the run's bytes of every channel row */
                for (int64_t d = 0; d < hd && !rc; ++d) {
                    const int64_t row = d * ds * es;
                    for (int64_t r = 0; r < g->num_runs && !rc; ++r) {
                        const int64_t rel = (rs[r].src_block - g->dst_block) * block;
                        rc = add_range(&s, part, 1, row + rs[r].dst_off * es, rs[r].len * es) |
                             add_range(&s, part, 0, rel + row + rs[r].src_off * es,
                                       rs[r].len * es);
                    }
                }
            }
            if (rc) { free(s.items); return 0; }
        }
        g->num_lines = s.count - g->first_line;
    }
    return s.items;
}

/* How far the prefetch cursor runs ahead of the copy, in lines. On the development VM (AMD
   EPYC, 48 KiB L1D, cold): with V streamed, 512 was 1-11% faster than 256 on 2 threads
   (most on SmolLM2 compaction and single-request trickle, within noise on llama8b);
   64 was up to 1.4x slower than 256, no prefetch up to 1.5x slower. */
#define PREFETCH_LINES 512

/* What vtoken_repack returns instead of a thread count (>= 1): nothing was copied. Defined
   here only; the Python side reads them by name (vtoken_repack_status_name). */
enum repack_status {
    REPACK_OUT_OF_MEMORY = -1,
    REPACK_OUT_OF_RANGE = -2,    /* a slot outside [0, num_slots) */
    REPACK_DST_TWICE = -3,       /* a destination appears twice */
    REPACK_DST_ALSO_SOURCE = -4, /* a destination is also a source: the moves would race */
};

/* 0 when the moves are a valid repack of slots [0, num_slots): in range, no destination
   twice, none also a source (sources are read while destinations are written); else the
   repack_status of the first problem found. One hash set of the destinations: a few
   microseconds for a decode step's moves, where the same checks through numpy cost tens of
   microseconds per call once the caches are cold. */
static int check_moves(const int64_t *src, const int64_t *dst, int64_t n, int64_t num_slots) {
    for (int64_t m = 0; m < n; ++m)
        if (src[m] < 0 || src[m] >= num_slots || dst[m] < 0 || dst[m] >= num_slots)
            return REPACK_OUT_OF_RANGE;
    int bits = 4;
    while ((1LL << bits) < 2 * n) ++bits;
    const uint64_t mask = (1ULL << bits) - 1;
    int64_t *set = (int64_t *)malloc((size_t)(mask + 1) * sizeof(int64_t));
    if (!set) return REPACK_OUT_OF_MEMORY;
    memset(set, 0xff, (size_t)(mask + 1) * sizeof(int64_t)); /* -1: empty */
    int status = 0;
    for (int64_t m = 0; m < 2 * n && !status; ++m) {
        const int64_t slot = m < n ? dst[m] : src[m - n];
        uint64_t h = ((uint64_t)slot * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        while (set[h] != -1 && set[h] != slot) h = (h + 1) & mask;
        if (set[h] == slot) status = m < n ? REPACK_DST_TWICE : REPACK_DST_ALSO_SOURCE;
        else if (m < n) set[h] = slot; /* sources may repeat: not inserted */
    }
    free(set);
    return status;
}

/* options: bit 0 disables the SIMD K path, bit 1 the software prefetch. num_slots >= 0: check
   the moves first (check_moves); -1: trust them. Returns the number of threads that ran
   (>= 1; 1 for no moves) or a repack_status (nothing was copied). */
int vtoken_repack(char **layers, int64_t num_layers, const int64_t *src, const int64_t *dst,
                  int64_t num_moves, int64_t block_size, int64_t kv_heads, int64_t head_dim,
                  int64_t elem_size, const int64_t *parts, int64_t num_threads, int64_t options,
                  int64_t num_slots) {
    if (num_moves <= 0 || num_layers <= 0) return 1;
    if (num_slots >= 0) {
        const int status = check_moves(src, dst, num_moves, num_slots);
        if (status) return status;
    }
    group_t *groups = (group_t *)calloc((size_t)num_moves, sizeof(group_t));
    run_t *runs = (run_t *)malloc((size_t)num_moves * sizeof(run_t));
    if (!groups || !runs) { free(groups); free(runs); return REPACK_OUT_OF_MEMORY; }
    int64_t ng = 0, nr = 0;
    for (int64_t m = 0; m < num_moves; ++m) {
        const int64_t sb = src[m] / block_size, so = src[m] % block_size;
        const int64_t db = dst[m] / block_size, dof = dst[m] % block_size;
        if (ng == 0 || groups[ng - 1].dst_block != db) {
            group_t g = {db, nr, 0, 0, 0, 0, 0};
            groups[ng++] = g;
        } else {
            run_t *last = runs + nr - 1;
            if (last->src_block == sb && last->src_off + last->len == so &&
                last->dst_off + last->len == dof) {
                last->len++;
                continue;
            }
        }
        run_t r = {sb, so, dof, 1};
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
        passes = build_passes(groups, ng, runs, elem_size, row_bytes, rows_per_tile, tile_bytes,
                              parts[1] * elem_size);
    if (num_threads > num_layers) num_threads = num_layers;
    if (num_threads < 1) num_threads = 1;
#ifndef _OPENMP
    num_threads = 1;
#endif
    job_t j = {layers, groups, runs, passes, 0, ng, block_size, kv_heads, head_dim, elem_size,
               tile_bytes, head_dim / rows_per_tile, parts, num_layers, kv_heads,
               (options & 2) ? 0 : PREFETCH_LINES, num_threads, 0, 0};
    if (contiguous_heads(&j, parts) && contiguous_heads(&j, parts + 5)) j.unit_heads = 1;
    j.stream_values = passes && j.unit_heads != 1 && whole_lines(&j, parts + 5, layers);
    int64_t *lines = 0;
    if (j.distance && !(lines = build_lines(&j, groups, runs))) j.distance = 0;
    j.lines = lines;
#ifdef _OPENMP
    /* The OpenMP runtime is torch's own (same soname, already loaded), so these are the
       threads torch's ops run on, not extra ones competing with them for cores. */
#pragma omp parallel num_threads((int)num_threads) if (num_threads > 1)
#endif
    run_job(&j);
    free(lines); free(passes); free(groups); free(runs);
    return (int)j.threads_ran;
}

/* Constants the Python side reads through the library rather than repeating them. */
int64_t vtoken_repack_prefetch_lines(void) { return PREFETCH_LINES; }

/* The name of a repack_status; NULL for any other value. */
const char *vtoken_repack_status_name(int status) {
    switch (status) {
        case REPACK_OUT_OF_MEMORY: return "out_of_memory";
        case REPACK_OUT_OF_RANGE: return "out_of_range";
        case REPACK_DST_TWICE: return "dst_twice";
        case REPACK_DST_ALSO_SOURCE: return "dst_also_source";
        default: return 0;
    }
}
