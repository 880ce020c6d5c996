// The decoder's float32 glue for AVX2 CPUs: RMSNorm (with the residual add), rotary embeddings and
// SwiGLU's activation. In PyTorch each is a handful of small ops, and at one token per forward their
// dispatch costs more than their arithmetic (a quarter of a 1.5B int4 decode step). Attention is
// attention.cpp.
//
// Batch invariance by construction, as in qlinear.cpp: each row's result is computed by one thread
// in a fixed order, whatever the number of rows or what else shares the forward.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>

#include "kernels.h"
#include "simd.h"

using simd::exp8;
using simd::hsum;

extern "C" {

namespace {

// One row: out = w * (x * (1 / sqrt(mean(x^2) + eps))), the reference implementations' order of
// operations; x += delta first where delta is set. out may be x.
inline void norm_row(float* xr, const float* delta, int64_t h, const float* w, float eps, float* out) {
    if (delta)
        for (int64_t i = 0; i < h; i += 8)
            _mm256_storeu_ps(xr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(delta + i)));
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < h; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), inv)));
}

}  // namespace

// x: [rows, h] (row stride ldx), w: [h], out: [rows, h] contiguous; h a multiple of 8.
// delta != null: x += delta first (the residual add, in place; delta row stride ldd).
void rms_norm(float* x, int64_t ldx, const float* delta, int64_t ldd, int64_t rows, int64_t h, const float* w,
              float eps, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * ldx, delta ? delta + r * ldd : nullptr, h, w, eps, out + r * h);
}

// In place on each row's q|k (x: [rows, q_size + k_size] with row stride ldx): every run of q_len
// values of q normed with q_norm, every run of k_len values of k with k_norm. Per head (Qwen3: q_len
// = k_len = head_dim) or over the whole projection (OLMo 2: q_len = q_size); lengths multiples of 8.
void qk_norms(float* x, int64_t ldx, int64_t rows, int64_t q_size, int64_t q_len, int64_t k_size, int64_t k_len,
              const float* q_norm, const float* k_norm, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        float* row = x + r * ldx;
        for (int64_t i = 0; i < q_size; i += q_len) norm_row(row + i, nullptr, q_len, q_norm, eps, row + i);
        for (int64_t i = 0; i < k_size; i += k_len)
            norm_row(row + q_size + i, nullptr, k_len, k_norm, eps, row + q_size + i);
    }
}

// Rotate-half ("NeoX") rotary embedding in place on `heads` heads of each row: x: [rows, heads, d]
// with row stride ldx; cos, sin: [max_positions, d]; positions: [rows]. d a multiple of 16.
// out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2 (separate multiplies, no FMA: the same
// rounding as the PyTorch formula).
void rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t d, const int64_t* positions,
          const float* cos, const float* sin) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; ++r) {
        const float* c = cos + positions[r] * d;
        const float* s = sin + positions[r] * d;
        for (int64_t hd = 0; hd < heads; ++hd) {
            float* p = x + r * ldx + hd * d;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 x1 = _mm256_loadu_ps(p + i), x2 = _mm256_loadu_ps(p + half + i);
                __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(x2, _mm256_loadu_ps(s + i)));
                __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(p + i, o1);
                _mm256_storeu_ps(p + half + i, o2);
            }
        }
    }
}

// SwiGLU's activation: out[r, i] = silu(gate[r, i]) * up[r, i], silu(g) = g / (1 + exp(-g)), with
// gate|up side by side in each row of x: [rows, 2 * n]; out: [rows, n]. n a multiple of 8. Each value
// is computed alone, so the threads split rows and columns alike (one row of 8,960 is two halves).
void silu_mul(const float* x, int64_t rows, int64_t n, float* out, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    constexpr int64_t kSpan = 2048;  // values a task
    const int64_t spans = (n + kSpan - 1) / kSpan;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 8192)
    for (int64_t task = 0; task < rows * spans; ++task) {
        const int64_t r = task / spans, i0 = task % spans * kSpan, i1 = std::min(n, i0 + kSpan);
        for (int64_t i = i0; i < i1; i += 8) {
            __m256 g = _mm256_loadu_ps(x + r * 2 * n + i), u = _mm256_loadu_ps(x + r * 2 * n + n + i);
            __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(out + r * n + i, _mm256_mul_ps(silu, u));
        }
    }
}

}  // extern "C"
