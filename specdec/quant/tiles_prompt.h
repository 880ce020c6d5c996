// Prompt tiles (32 rows and more): each thread takes a tile of features and runs every row of the call
// through it. With int8 activations on AVX2, Q6_K's weights are first decoded once into the vectors the
// products read (6-bit codes as bytes, each 32 values' pair of group scales as int16); the integer sums
// land in the same lanes as tile_super's, and span_tile flushes and finishes them as it does, so every
// row's output is bitwise the decode path's.
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
// A Q6_K super-block decoded: its 16 widened scales, then per 32 values 32 codes as bytes and their two
// groups' scales (pair_scales), 544 bytes. Q4_K's codes are read packed: they unpack in three
// instructions per 64 values, and decoded (2.7 times the bytes) a 256-row projection ran at 0.92x.
constexpr int64_t kDecoded6 = 32 + 8 * 64;

inline void decode_super6(const uint8_t* codes, const int8_t* sub, int64_t supers, uint8_t* out) {
    for (int64_t sb = 0; sb < supers; ++sb, out += kDecoded6) {
        alignas(32) int16_t s[16];
        widen_scales<16>(sub + sb * 16, s);
        _mm256_storeu_si256((__m256i*)out, load256(s));
        for (int h = 0; h < 2; ++h) {
            __m256i u[4];
            codes6(codes + sb * 192 + 96 * h, u);
            for (int p = 0; p < 4; ++p) {
                uint8_t* q = out + 32 + 64 * (4 * h + p);
                _mm256_storeu_si256((__m256i*)q, u[p]);
                _mm256_storeu_si256((__m256i*)(q + 32), pair_scales(s + 8 * h + 2 * p));
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
        for (int q = 0; q < 8; ++q) {  // 32 values: groups 2q and 2q + 1
            const __m256i u = load256(ws + 32 + 64 * q), sc = load256(ws + 64 + 64 * q);
            for (int r = 0; r < MT; ++r) {
                const __m256i x = load256(xq + r * k + sb * 256 + 32 * q);
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc));
            }
        }
        unsigned6_correction<MT>(isums, k, sb, (const int16_t*)ws, sum);
    }, less);
}
#endif

}  // namespace
