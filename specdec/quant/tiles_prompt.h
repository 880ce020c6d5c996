// Prompt tiles (32 rows and more): each thread takes a tile of features and runs every row of the call
// through it. With int8 activations on AVX2, Q6_K's weights are first decoded once into the vectors the
// products read (6-bit codes as bytes split by split_words, each 64 values' group scales as int16); the
// integer sums land in the same lanes as tile_super's, and span_tile flushes and finishes them as it
// does, so every row's output is bitwise the decode path's.
#pragma once
#include "tiles_int8_x.h"

namespace {

// Rows from which a call is a prompt's: a thread takes a tile of features whose decoded weights fill
// about kPromptTileBytes of L2 and runs every row through it, kPromptSpan rows at a time (their int8
// activations stay in L2 too), so the weights come from memory once per call, not once per row block
// (ffn_down's 8-row blocks read its codes 32 times for 256 rows).
constexpr int64_t kPromptRows = 32;
constexpr int64_t kPromptTileBytes = 96 * 1024;
constexpr int64_t kPromptSpan = 12;

inline int64_t prompt_features(int64_t feature_bytes) {
    const int64_t f = kPromptTileBytes / (feature_bytes > 0 ? feature_bytes : 1);
    return f < 2 ? 2 : f;
}

#ifndef __AVX512VNNI__
// A Q6_K super-block decoded: its 16 widened scales, then per 64 values its codes as bytes split in two
// vectors (split_words) and their four groups' scales (split_scales), 416 bytes. Q4_K's codes are read
// packed: they unpack in three instructions per 64 values, and decoded (2.7 times the bytes) a 256-row
// projection ran at 0.92x.
constexpr int64_t kDecoded6 = 32 + 4 * 96;

inline void decode_super6(const uint8_t* codes, const int8_t* sub, int64_t supers, uint8_t* out) {
    for (int64_t sb = 0; sb < supers; ++sb, out += kDecoded6) {
        alignas(32) int16_t s[16];
        widen_scales<16>(sub + sb * 16, s);
        _mm256_storeu_si256((__m256i*)out, load256(s));
        for (int h = 0; h < 2; ++h) {
            __m256i u[4];
            codes6(codes + sb * 192 + 96 * h, u);
            for (int q = 0; q < 2; ++q) {
                __m256i even, odd;
                split_words(u[2 * q], u[2 * q + 1], &even, &odd);
                uint8_t* d = out + 32 + 96 * (2 * h + q);
                _mm256_storeu_si256((__m256i*)d, even);
                _mm256_storeu_si256((__m256i*)(d + 32), odd);
                _mm256_storeu_si256((__m256i*)(d + 64), split_scales(s + 8 * h + 4 * q));
            }
        }
    }
}

// tile_super<6, MT>'s sums from decoded weights w (decode_super6): the same products in the same lanes.
template <int MT>
inline void prompt_tile6(const int8_t* xq, const float* dx, int64_t k, const float* xsum, const int16_t* isums,
                         const uint8_t* w, const float* dsup, const float* offset, float* y, int64_t ldy,
                         const float* less) {
    span_tile<MT, 256, 16>(k, dx, dsup, xsum, offset, y, ldy, [&](int64_t sb, __m256i* sum) {
        const uint8_t* ws = w + sb * kDecoded6;
        for (int q = 0; q < 4; ++q) {  // 64 values: groups 4q .. 4q + 3
            const uint8_t* d = ws + 32 + 96 * q;
            const __m256i even = load256(d), odd = load256(d + 32), sc = load256(d + 64);
            for (int r = 0; r < MT; ++r)
                sum[r] = _mm256_add_epi32(sum[r], split_dot(even, odd, xq + r * k + sb * 256 + 64 * q, sc));
        }
        unsigned6_correction<MT>(isums, k, sb, (const int16_t*)ws, sum);
    }, less);
}
#endif

}  // namespace
