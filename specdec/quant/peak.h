// This machine's two peaks, the bounds `bench steps` states each forward against.
//
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
    // In assembly, as AVX2's below: written with intrinsics, twelve chains with the same start and operands
    // are one value to the compiler, which kept a single chain (its latency, counted as twelve chains'
    // work, overstated a Zen 4's rate 3x).
#ifdef __AVX512VNNI__
#define SPECDEC_PEAK_STEP(c) "vpdpbusd %%zmm1, %%zmm0, %%zmm" #c "\n\t"
    int64_t n = iters;
    __asm__ volatile(
        "vpternlogd $0xFF, %%zmm0, %%zmm0, %%zmm0\n\t"
        "vpabsb %%zmm0, %%zmm0\n\t"  // unsigned 1s, and the same bytes as the signed operand
        "vmovdqa64 %%zmm0, %%zmm1\n\t"
        "vpxord %%zmm2, %%zmm2, %%zmm2\n\t vpxord %%zmm3, %%zmm3, %%zmm3\n\t vpxord %%zmm4, %%zmm4, %%zmm4\n\t"
        "vpxord %%zmm5, %%zmm5, %%zmm5\n\t vpxord %%zmm6, %%zmm6, %%zmm6\n\t vpxord %%zmm7, %%zmm7, %%zmm7\n\t"
        "vpxord %%zmm8, %%zmm8, %%zmm8\n\t vpxord %%zmm9, %%zmm9, %%zmm9\n\t vpxord %%zmm10, %%zmm10, %%zmm10\n\t"
        "vpxord %%zmm11, %%zmm11, %%zmm11\n\t vpxord %%zmm12, %%zmm12, %%zmm12\n\t vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
        "1:\n\t" SPECDEC_PEAK_STEP(2) SPECDEC_PEAK_STEP(3) SPECDEC_PEAK_STEP(4) SPECDEC_PEAK_STEP(5)
        SPECDEC_PEAK_STEP(6) SPECDEC_PEAK_STEP(7) SPECDEC_PEAK_STEP(8) SPECDEC_PEAK_STEP(9) SPECDEC_PEAK_STEP(10)
        SPECDEC_PEAK_STEP(11) SPECDEC_PEAK_STEP(12) SPECDEC_PEAK_STEP(13)
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(n)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "cc");
#undef SPECDEC_PEAK_STEP
    return iters * 12 * 64;
#else
    // In assembly likewise: with intrinsics and operands it may not hoist, the compiler kept them on the
    // stack (0.56x this rate).
    // Four chains of two vpmaddubsw sharing one widening (their int16 sum is exact for 4- and 6-bit
    // codes, as Q4_K tiles do), 256 multiply-adds an iteration.
#define SPECDEC_PEAK_CHAIN(p, q, c)                                                                   \
    "vpmaddubsw %%ymm" #p ", %%ymm0, %%ymm14\n\t"                                                  \
    "vpmaddubsw %%ymm" #q ", %%ymm0, %%ymm15\n\t"                                                  \
    "vpaddw %%ymm15, %%ymm14, %%ymm14\n\t"                                                          \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t"                                                        \
    "vpaddd %%ymm14, %%ymm" #c ", %%ymm" #c "\n\t"
    int64_t n = iters;
    __asm__ volatile(
        "vpcmpeqb %%ymm0, %%ymm0, %%ymm0\n\t"
        "vpabsb %%ymm0, %%ymm0\n\t"  // unsigned 1s; the signed operands and the widening's 1s likewise
        "vmovdqa %%ymm0, %%ymm1\n\t vmovdqa %%ymm0, %%ymm2\n\t vmovdqa %%ymm0, %%ymm3\n\t"
        "vmovdqa %%ymm0, %%ymm4\n\t vmovdqa %%ymm0, %%ymm5\n\t vmovdqa %%ymm0, %%ymm6\n\t"
        "vmovdqa %%ymm0, %%ymm7\n\t vmovdqa %%ymm0, %%ymm8\n\t vpsrlw $8, %%ymm0, %%ymm13\n\t"
        "vpxor %%ymm9, %%ymm9, %%ymm9\n\t vpxor %%ymm10, %%ymm10, %%ymm10\n\t"
        "vpxor %%ymm11, %%ymm11, %%ymm11\n\t vpxor %%ymm12, %%ymm12, %%ymm12\n\t"
        "1:\n\t" SPECDEC_PEAK_CHAIN(1, 2, 9) SPECDEC_PEAK_CHAIN(3, 4, 10) SPECDEC_PEAK_CHAIN(5, 6, 11)
        SPECDEC_PEAK_CHAIN(7, 8, 12)
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(n)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "xmm15", "cc");
#undef SPECDEC_PEAK_CHAIN
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

// Seconds for one read of [p, p + bytes) on `threads` threads, each its own contiguous share, asking
// for the lines 8 KB ahead into L2: a read stream with nothing to compute, the bandwidth the kernels'
// streams can reach (a library's sum reached 0.65-0.85x it on a Xeon VM).
inline double read_pass(const uint8_t* p, int64_t bytes, int threads) {
    double start = 0, stop = 0;
    int sink = 0;
#pragma omp parallel num_threads(threads) reduction(| : sink)
    {
        const int64_t share = bytes / omp_get_num_threads() / 256 * 256, b0 = omp_get_thread_num() * share;
        __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
#pragma omp barrier
#pragma omp master
        start = omp_get_wtime();
        for (const uint8_t* q = p + b0; q < p + b0 + share; q += 256) {
            for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)q + 8192 + 64 * l, _MM_HINT_T1);
            for (int v = 0; v < 8; ++v) a[v % 4] = _mm256_or_si256(a[v % 4], _mm256_loadu_si256((const __m256i*)q + v));
        }
        sink |= _mm256_movemask_epi8(_mm256_or_si256(_mm256_or_si256(a[0], a[1]), _mm256_or_si256(a[2], a[3])));
#pragma omp barrier
#pragma omp master
        stop = omp_get_wtime();
    }
    volatile int keep = sink;  // the loads must happen
    (void)keep;
    return stop - start;
}

// The same loop built with AVX-512 VNNI (qlinear_vnni.cpp); qlinear.cpp's int8_peak calls it where the
// integer paths run with VNNI.
double int8_peak_vnni(int threads, double seconds);
