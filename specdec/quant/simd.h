// Small AVX2 helpers shared by the CPU kernels (qlinear.cpp, layer_ops.cpp, attention.cpp).
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

namespace simd {

// One line into L1 (T0) or L2 (T1), as an asm statement: GCC 12 deleted loops of _mm_prefetch calls as
// dead code once two of them were inlined into one function (the K-quant tiles then ran without any).
template <_mm_hint HINT>
inline void prefetch(const void* p) {
    static_assert(HINT == _MM_HINT_T0 || HINT == _MM_HINT_T1);
    if constexpr (HINT == _MM_HINT_T0) asm volatile("prefetcht0 %0" : : "m"(*(const char*)p));
    else asm volatile("prefetcht1 %0" : : "m"(*(const char*)p));
}

// The 8 lanes' sum, in a fixed order (batch invariance needs every reduction's order fixed).
inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// The 8 lanes' maximum.
inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// The largest of v[0, n), 8 at a time (a NaN is passed over, as max_ps does).
inline float largest(const float* v, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(v + c));
    float top = hmax8(m);
    for (; c < n; ++c) top = v[c] > top ? v[c] : top;
    return top;
}

// exp: Cephes' range reduction and polynomial, about 1 ulp; below -87 the result is 0, above 88 it
// saturates at exp(88).
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

#ifdef __AVX512F__
// exp8 on 16 lanes: the same operations lane by lane, so the same bits.
inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(_knot_mask16(under), _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}
#endif

// f(std::integral_constant<int, n>{}) for a count 1 <= n <= N known only at run time: the kernels are
// templated on their row or vector counts (register tiles). Any other n calls nothing.
template <int N = 7, class F>
inline void with_count(int64_t n, F&& f) {
    if constexpr (N >= 1) {
        if (n == N) f(std::integral_constant<int, N>{});
        else with_count<N - 1>(n, f);
    }
}

}  // namespace simd
