/* The reference the streaming-read roofline (worker/src/roofline.rs) is held against: the
 * simplest fast OpenMP read of the same byte count, summing 64-bit words (with four explicit
 * 512-bit accumulators when built for AVX-512, where the compiler's own loop read about 15%
 * less on a Xeon; otherwise the compiler's widest vectors), best of REPS passes after one
 * untimed pass. Baton's own code; see docs/benchmarks.md for how it is built and run.
 *
 *   gcc -O3 -march=native -fopenmp bench/stream_read.c -o /tmp/stream_read
 *   OMP_NUM_THREADS=2 /tmp/stream_read BYTES [REPS]
 */
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s BYTES [REPS]\n", argv[0]);
        return 2;
    }
    size_t words = strtoull(argv[1], NULL, 10) / 8;
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    if (words == 0 || reps < 1) {
        fprintf(stderr, "BYTES must be at least 8 and REPS at least 1\n");
        return 2;
    }
    uint64_t *buf = malloc(words * sizeof *buf);
    if (!buf) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < words; i++) buf[i] = i * 0x9E3779B97F4A7C15ull;
    double best = 0;
    uint64_t check = 0;
    for (int rep = 0; rep <= reps; rep++) {
        uint64_t sum = 0;
        double t = omp_get_wtime();
#ifdef __AVX512F__
#pragma omp parallel reduction(+ : sum)
        {
            /* Each thread one contiguous share of whole 32-word blocks; the last takes the tail. */
            size_t n = omp_get_num_threads(), id = omp_get_thread_num();
            size_t lo = words * id / n / 32 * 32, hi = id + 1 == n ? words : words * (id + 1) / n / 32 * 32;
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            size_t i = lo;
            for (; i + 32 <= hi; i += 32) {
                a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(buf + i));
                a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(buf + i + 8));
                a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(buf + i + 16));
                a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(buf + i + 24));
            }
            uint64_t part = _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
            for (; i < hi; i++) part += buf[i];
            sum += part;
        }
#else
#pragma omp parallel for reduction(+ : sum) schedule(static)
        for (size_t i = 0; i < words; i++) sum += buf[i];
#endif
        t = omp_get_wtime() - t;
        check ^= sum;
        double gbs = words * 8.0 / t / 1e9;
        if (rep > 0 && gbs > best) best = gbs;
    }
    printf("{\"bytes\": %zu, \"threads\": %d, \"reps\": %d, \"best_gb_per_s\": %.2f, \"check\": %llu}\n",
           words * 8, omp_get_max_threads(), reps, best, (unsigned long long)check);
    free(buf);
    return 0;
}
