/* The memory floor of a CPU repack (bench/memory_floor.py plans the lines and explains it):
   in every layer, rewrite one byte of each partly-changed line, stream a zero line over each
   whole line, load each read line, every kind in the given (address) order; partial and
   read lines are prefetched `ahead` lines early with the non-temporal hint, as the repack
   prefetches (the caller passes the repack's distance, vtoken_repack_prefetch_lines), and
   layers are split over `threads` OpenMP threads as the repack splits them. Offsets are
   bytes from a layer's base. */

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

void vtoken_floor(char **layers, int64_t num_layers, const int64_t *partial,
                  int64_t num_partial, const int64_t *whole, int64_t num_whole,
                  const int64_t *reads, int64_t num_reads, int64_t ahead, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads((int)threads) if (threads > 1)
#endif
    for (int64_t l = 0; l < num_layers; ++l) {
        char *base = layers[l];
        for (int64_t i = 0; i < num_partial; ++i) {
            if (i + ahead < num_partial) __builtin_prefetch(base + partial[i + ahead], 0, 0);
            volatile char *p = base + partial[i];
            *p = *p;
        }
        for (int64_t i = 0; i < num_whole; ++i) {
#if defined(__x86_64__)
            __m128i *p = (__m128i *)(base + whole[i]);
            const __m128i zero = _mm_setzero_si128();
            for (int k = 0; k < 4; ++k) _mm_stream_si128(p + k, zero);
#else
            memset(base + whole[i], 0, 64);
#endif
        }
        for (int64_t i = 0; i < num_reads; ++i) {
            if (i + ahead < num_reads) __builtin_prefetch(base + reads[i + ahead], 0, 0);
            (void)*(volatile const char *)(base + reads[i]);
        }
#if defined(__x86_64__)
        _mm_sfence();
#endif
    }
}
