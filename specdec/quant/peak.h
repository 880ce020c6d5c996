// The int8 multiply-add peak of this core: independent chains of the dot-product idiom the integer
// kernels use, with nothing else in the loop (no loads, no scales), so the rate is the instructions'
// own. AVX2 (qlinear.cpp's build): u8 x s8 pairs summed to int16 (vpmaddubsw) twice, the two added
// (vpaddw), then summed to int32 (vpmaddwd) and accumulated (vpaddd): 64 multiply-adds. AVX-512 VNNI
// (qlinear_vnni.cpp's build): one vpdpbusd, 64. `bench steps` states each forward against this rate.
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

// Multiply-adds one thread does in `iters` steps of its chains (enough chains to cover the
// instructions' latency at two issues a cycle).
inline int64_t int8_peak_chains(int64_t iters) {
    // named registers, not arrays: an array the asm barrier touches lives on the stack
#ifdef __AVX512VNNI__
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
            c9 = c0, c10 = c0, c11 = c0;
    for (int64_t i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+v"(a), "+v"(b));  // operands the compiler cannot hoist
#define SPECDEC_PEAK_STEP(c) c = _mm512_dpbusd_epi32(c, a, b);
        SPECDEC_PEAK_STEP(c0) SPECDEC_PEAK_STEP(c1) SPECDEC_PEAK_STEP(c2) SPECDEC_PEAK_STEP(c3)
        SPECDEC_PEAK_STEP(c4) SPECDEC_PEAK_STEP(c5) SPECDEC_PEAK_STEP(c6) SPECDEC_PEAK_STEP(c7)
        SPECDEC_PEAK_STEP(c8) SPECDEC_PEAK_STEP(c9) SPECDEC_PEAK_STEP(c10) SPECDEC_PEAK_STEP(c11)
#undef SPECDEC_PEAK_STEP
    }
    const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                       _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    volatile int sink = _mm512_reduce_add_epi32(_mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8, c9),
                                                                                      _mm512_add_epi32(c10, c11))));
    (void)sink;
    return iters * 12 * 64;
#else
    // each chain its own operands, marked changed every step: the products cannot be shared or hoisted.
    // Two products share one widening (their int16 sum is exact for 4- and 6-bit codes), as Q4_K tiles do.
    const __m256i a = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
    __m256i b0 = _mm256_set1_epi8(-1), b1 = _mm256_set1_epi8(-2), b2 = _mm256_set1_epi8(-3),
            b3 = _mm256_set1_epi8(-4), b4 = _mm256_set1_epi8(-5), b5 = _mm256_set1_epi8(-6),
            b6 = _mm256_set1_epi8(-7), b7 = _mm256_set1_epi8(-8);
    for (int64_t i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+x"(b0), "+x"(b1), "+x"(b2), "+x"(b3), "+x"(b4), "+x"(b5), "+x"(b6), "+x"(b7));
#define SPECDEC_PEAK_STEP(c, p, q)                                                                     \
    c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, p),            \
                                                                _mm256_maddubs_epi16(a, q)), ones));
        SPECDEC_PEAK_STEP(c0, b0, b1) SPECDEC_PEAK_STEP(c1, b2, b3) SPECDEC_PEAK_STEP(c2, b4, b5)
        SPECDEC_PEAK_STEP(c3, b6, b7)
#undef SPECDEC_PEAK_STEP
    }
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3));
    volatile int sink = _mm256_extract_epi32(s, 0);
    (void)sink;
    return iters * 4 * 64;
#endif
}

// Multiply-adds a second on `threads` threads together, each running its chains for about `seconds`.
inline double int8_peak_rate(int threads, double seconds) {
    double start = 0, stop = 0;
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#pragma omp barrier
        const double t0 = omp_get_wtime();
#pragma omp master
        start = t0;
        do total += int8_peak_chains(1 << 14);
        while (omp_get_wtime() - t0 < seconds);
#pragma omp barrier
#pragma omp master
        stop = omp_get_wtime();
    }
    return (double)total / (stop - start);
}

// The same loop built with AVX-512 VNNI (qlinear_vnni.cpp); qlinear.cpp's int8_peak calls it where the
// integer paths run with VNNI.
double int8_peak_vnni(int threads, double seconds);
