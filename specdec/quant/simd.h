// Small AVX2 helpers shared by the CPU kernels (qlinear.cpp, layer_ops.cpp).
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include <type_traits>

namespace simd {

// The 8 lanes' sum, in a fixed order (batch invariance needs every reduction's order fixed).
inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

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
