/* The reference the streaming-read roofline (worker/src/roofline.rs) is held against: the
 * simplest fast OpenMP read of the same byte count, summing 64-bit words, best of REPS passes
 * after one untimed pass, for each loop: the compiler's own, four explicit 256-bit
 * accumulators (AVX2; fastest on a Zen 4 EPYC) and four 512-bit ones (AVX-512; fastest on a
 * Xeon, where the compiler's loop read about 15% less). It reports each loop's best and the
 * best of all. Baton's own code; see docs/benchmarks.md for how it is built and run.
 *
 *   gcc -O3 -march=native -fopenmp bench/stream_read.c -o /tmp/stream_read
 *   OMP_NUM_THREADS=2 /tmp/stream_read BYTES [REPS]
 */
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Each thread one contiguous share of whole 32-word blocks; the last takes the tail. */
static void share(size_t words, size_t *lo, size_t *hi) {
    size_t n = omp_get_num_threads(), id = omp_get_thread_num();
    *lo = words * id / n / 32 * 32;
    *hi = id + 1 == n ? words : words * (id + 1) / n / 32 * 32;
}

static uint64_t read_plain(const uint64_t *buf, size_t words) {
    uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (size_t i = 0; i < words; i++) sum += buf[i];
    return sum;
}

#ifdef __AVX2__
static uint64_t read_avx2(const uint64_t *buf, size_t words) {
    uint64_t sum = 0;
#pragma omp parallel reduction(+ : sum)
    {
        size_t lo, hi;
        share(words, &lo, &hi);
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        size_t i = lo;
        for (; i + 16 <= hi; i += 16) {
            a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(buf + i)));
            a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(buf + i + 4)));
            a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(buf + i + 8)));
            a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(buf + i + 12)));
        }
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
        uint64_t part = lanes[0] + lanes[1] + lanes[2] + lanes[3];
        for (; i < hi; i++) part += buf[i];
        sum += part;
    }
    return sum;
}
#endif

#ifdef __AVX512F__
static uint64_t read_avx512(const uint64_t *buf, size_t words) {
    uint64_t sum = 0;
#pragma omp parallel reduction(+ : sum)
    {
        size_t lo, hi;
        share(words, &lo, &hi);
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
    return sum;
}
#endif

typedef uint64_t (*read_fn)(const uint64_t *, size_t);

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
    const char *names[3] = {"plain", "avx2", "avx512"};
    read_fn loops[3] = {read_plain, NULL, NULL};
#ifdef __AVX2__
    loops[1] = read_avx2;
#endif
#ifdef __AVX512F__
    loops[2] = read_avx512;
#endif
    double best = 0, each[3] = {0, 0, 0};
    uint64_t check = 0;
    for (int l = 0; l < 3; l++) {
        if (!loops[l]) continue;
        for (int rep = 0; rep <= reps; rep++) {
            double t = omp_get_wtime();
            uint64_t sum = loops[l](buf, words);
            t = omp_get_wtime() - t;
            check ^= sum;
            double gbs = words * 8.0 / t / 1e9;
            if (rep > 0 && gbs > each[l]) each[l] = gbs;
        }
        if (each[l] > best) best = each[l];
    }
    printf("{\"bytes\": %zu, \"threads\": %d, \"reps\": %d, \"best_gb_per_s\": %.2f", words * 8, omp_get_max_threads(), reps, best);
    for (int l = 0; l < 3; l++)
        if (loops[l]) printf(", \"%s_gb_per_s\": %.2f", names[l], each[l]);
    printf(", \"check\": %llu}\n", (unsigned long long)check);
    free(buf);
    return 0;
}
