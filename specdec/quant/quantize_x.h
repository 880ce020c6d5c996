// Activation quantization: x rounded to int8 per 32 or 256 values (int4-a8) or to int16 per 256 (int4-a16),
// once per projection input, with the per-group sums the offsets need.
#pragma once
#include "tiles_common.h"

namespace {

// max |x| over n values (a multiple of 8).
inline float abs_max(const float* x, int n) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + i), abs));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// x rounded to int8 per `block` values: x ~= dx[r, b] * xq[r, b, :], dx = max|x| / 127 (round to
// nearest). With xsum ([rows, k / G]), also each group's sum of the rounded values, dx times an exact
// integer sum: the offsets (Q4_0's -8d, Q4_1's minimum) then multiply the same x as the codes, so a
// product is w . x_rounded (llama.cpp's bsums). With the unrounded sums instead, the rounding error was
// weighted by the unsigned codes s * q, several times the centred weights (docs/cpu-kernels.md).
// With isums ([rows, k / G] int16), each group's exact integer sum of the rounded values (Q4_K's
// minimums, Q6_K's offset of 32: tiles_rows16.h).
template <int G>
void quantize_rows(const float* x, int64_t rows, int64_t k, int block, int8_t* xq, float* dx,
                   float* xsum, int16_t* isums = nullptr) {
    const int64_t blocks = k / block;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* xb = x + r * k + b * block;
            int8_t* qb = xq + r * k + b * block;
            const float d = abs_max(xb, block) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            dx[r * blocks + b] = d;
            const __m256 vid = _mm256_set1_ps(id);
            for (int g = 0; g < block / G; ++g) {
                __m256i sum = _mm256_setzero_si256();
                // 16 values at a time (round to nearest even, as nearbyint)
                for (int i = g * G; i < (g + 1) * G; i += 16) {
                    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
                    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
                    sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, c));
                    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);  // 16 int16 in order
                    _mm_storeu_si128((__m128i*)(qb + i),
                                     _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
                }
                const int32_t isum = hsum_epi32(sum);
                if (xsum) xsum[(r * k + b * block) / G + g] = d * (float)isum;
                if (isums) isums[(r * k + b * block) / G + g] = (int16_t)isum;
            }
        }
}

// x rounded to int16 per 256 values: x ~= dx[r, b] * xq[r, b, :], dx = max|x| / 32767 (int4-a16).
void quantize_rows16(const float* x, int64_t rows, int64_t k, int16_t* xq, float* dx) {
    const int64_t blocks = k / 256;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* xb = x + r * k + b * 256;
            int16_t* qb = xq + r * k + b * 256;
            const float d = abs_max(xb, 256) / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
            dx[r * blocks + b] = d;
            const __m256 vid = _mm256_set1_ps(id);
            for (int i = 0; i < 256; i += 16) {  // round to nearest even, as nearbyint
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
                const __m256i b2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
                // packs works per 128-bit lane: put the halves back in order
                _mm256_storeu_si256((__m256i*)(qb + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b2), 0xD8));
            }
        }
}

}  // namespace
