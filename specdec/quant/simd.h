// Small AVX2 helpers shared by the CPU kernels (qlinear.cpp, layer_ops.cpp).
#pragma once
#include <immintrin.h>

namespace simd {

// The 8 lanes' sum, in a fixed order (batch invariance needs every reduction's order fixed).
inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

}  // namespace simd
