// Products with int8 activations (precision int4-a8) on per-group scales: a float scale and offset per G
// values (the file's Q4_0, Q4_1, Q5_0, Q8_0: 32; a draft requantized per 64 reads tiles_rows16_g64.h).
// x is rounded per G values too, so each group's dot product is one exact int32 sum per lane and one float
// multiply-add; the float order is fixed. Built for AVX2 and again for AVX-512 VNNI with the same sums.
#pragma once
#include "tiles_common.h"

namespace {

// x row r, group g ~= sx[r, g] * xq[r, g, :] (round to nearest, |xq| <= 127). Per group the dot product
// of codes and xq is exact in int32 (vpmaddubsw + vpmaddwd, or vpdpbusd); the float accumulation order is fixed.

inline __m256i codes4(const uint8_t* p) {  // 32 unsigned codes, element order
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// Codes of the 32 values of block b (BITS 4 unsigned, 8 signed).
template <int BITS>
inline __m256i codes32(const uint8_t* c, int64_t b) {
    if constexpr (BITS == 4) return codes4(c + b * 16);
    else return load256(c + b * 32);
}

// acc + the exact products of 32 codes and 32 values of x, 8 int32 lanes of 4 consecutive values each
inline __m256i dot32(__m256i acc, __m256i w, __m256i xq, bool is_signed) {
    // vpmaddubsw takes unsigned x signed bytes: a signed w moves its sign onto x
    __m256i u = is_signed ? _mm256_sign_epi8(w, w) : w;
    __m256i v = is_signed ? _mm256_sign_epi8(xq, w) : xq;
#ifdef __AVX512VNNI__
    return _mm256_dpbusd_epi32(acc, u, v);
#else  // pairs of products are at most 2 * 127 * 127: vpmaddubsw never saturates, so both are exact
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
#endif
}

template <int BITS, int G, int MT>
inline void tile_a8(const int8_t* xq, const float* sx, int64_t k, const float* xsum, const void* codes,
                    const float* scale, const float* offset, float* y, int64_t ldy) {
    constexpr int S = G / 32;  // blocks of 32 a group
    const int64_t groups = k / G;
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256i w[S];
        for (int s = 0; s < S; ++s) w[s] = codes32<BITS>((const uint8_t*)codes, g * S + s);
        const __m256 ws = _mm256_broadcast_ss(scale + g);  // one group (Q6_K's groups of 16: tile_super)
        for (int r = 0; r < MT; ++r) {
            __m256i d = _mm256_setzero_si256();
            for (int s = 0; s < S; ++s) d = dot32(d, w[s], load256(xq + r * k + g * G + 32 * s), BITS == 8);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws, _mm256_broadcast_ss(sx + r * groups + g)),
                                     _mm256_cvtepi32_ps(d), acc[r]);
        }
    }
    finish<MT>(acc, groups, xsum, offset, y, ldy);
}

#ifdef __AVX512VNNI__
inline __m512 halves(__m256 lo, __m256 hi) {  // AVX-512F only (no DQ in this build)
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// ---- two features at a time: feature j in a vector's low 256 bits, j + 1 in its high ----
// Each half computes exactly what tile_a8 computes for its feature (the same int32 lanes, the same float
// multiply and multiply-add per lane and group), so the results are tile_a8's bitwise; one instruction
// does both features' float work, which bounds a one-row product of 4-bit codes.
template <int BITS>
inline __m512i codes_pair(const uint8_t* a, const uint8_t* b) {
    if constexpr (BITS == 4) {  // 128-bit lanes [a low, a high, b low, b high] nibbles: codes4 of each
        const __m512i raw = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)a))),
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b)), 1);
        const int64_t f = 0x0004000400040004;  // int16 shift counts: 4 in 128-bit lanes 1 and 3
        return _mm512_and_si512(_mm512_srlv_epi16(raw, _mm512_set_epi64(f, f, 0, 0, f, f, 0, 0)), _mm512_set1_epi8(0x0F));
    } else {
        return _mm512_inserti64x4(_mm512_castsi256_si512(load256(a)), load256(b), 1);
    }
}

// dot32 on both halves: acc + 16 lanes of 4 consecutive values' exact products
template <int BITS>
inline __m512i dot32_pair(__m512i acc, __m512i w, __m512i x) {
    if constexpr (BITS == 8) {  // vpdpbusd takes unsigned x signed bytes: a signed w moves its sign onto x
        x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
        w = _mm512_abs_epi8(w);
    }
    return _mm512_dpbusd_epi32(acc, w, x);
}

// The lines of [from, from + n) bytes past p not yet prefetched by the calls for earlier spans (one per line).
inline void prefetch_span(const uint8_t* p, int64_t from, int64_t n) {
    for (int64_t b = (from + 63) / 64 * 64; b < from + n; b += 64) simd::prefetch<_MM_HINT_T0>((const char*)p + b);
}

// At group g of a tile of 2 * NP features: the next tile's codes (`span` bytes a group), a line per 64 bytes
// read here, and its scales and offsets. The features that follow are the ones this thread runs next, so
// the stream runs ahead without a fixed distance.
template <int NP>
inline void prefetch_next(const uint8_t* next, int64_t g, int64_t span, const float* s, const float* o,
                          int64_t groups) {
    prefetch_span(next, g * span, span);
    if (g < (2 * NP * groups * 4 + 63) / 64) {
        simd::prefetch<_MM_HINT_T0>((const char*)(s + 2 * NP * groups) + 64 * g);
        if (o) simd::prefetch<_MM_HINT_T0>((const char*)(o + 2 * NP * groups) + 64 * g);
    }
}

// Group g's scales of pair p's two features (scales s, `groups` a feature), one per half.
inline __m512 pair_scale(const float* s, int64_t groups, int p, int64_t g) {
    return halves(_mm256_broadcast_ss(s + 2 * p * groups + g), _mm256_broadcast_ss(s + (2 * p + 1) * groups + g));
}

// Each pair's two features from the halves of its accumulators: tile_a8's finish of each.
template <int MT, int NP>
inline void finish_pairs(const __m512 (*acc)[MT], int64_t groups, const float* xsum, const float* o, float* y,
                         int64_t ldy) {
    for (int p = 0; p < NP; ++p) {
        __m256 lo[MT], hi[MT];
        for (int r = 0; r < MT; ++r) {
            lo[r] = _mm512_castps512_ps256(acc[p][r]);
            hi[r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][r]), 1));
        }
        finish<MT>(lo, groups, xsum, o ? o + 2 * p * groups : nullptr, y + 2 * p, ldy);
        finish<MT>(hi, groups, xsum, o ? o + (2 * p + 1) * groups : nullptr, y + 2 * p + 1, ldy);
    }
}

// 2 * NP consecutive features for MT rows, tile_a8's arithmetic: feature f's codes at c + f * bytes, its
// scales and offsets at s + f * groups and o + f * groups (o may be null). NP pairs run independent
// multiply-add chains, which one pair alone waits on at one row.
template <int BITS, int G, int MT, int NP>
inline void tile_a8_pairs(const int8_t* xq, const float* sx, int64_t k, const float* xsum, const uint8_t* c,
                          int64_t bytes, const float* s, const float* o, float* y, int64_t ldy) {
    constexpr int S = G / 32, SPAN = 2 * NP * BITS * 4 * S;  // a group's codes in the tile, all features
    const int64_t groups = k / G;
    __m512 acc[NP][MT];
    for (int p = 0; p < NP; ++p)
        for (int r = 0; r < MT; ++r) acc[p][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        prefetch_next<NP>(c + 2 * NP * bytes, g, SPAN, s, o, groups);
        __m512i w[NP][S];
        __m512 ws[NP];
        for (int p = 0; p < NP; ++p) {
            const uint8_t* a = c + 2 * p * bytes + g * S * BITS * 4;
            for (int b = 0; b < S; ++b) w[p][b] = codes_pair<BITS>(a + b * BITS * 4, a + bytes + b * BITS * 4);
            ws[p] = pair_scale(s, groups, p, g);
        }
        for (int r = 0; r < MT; ++r) {
            __m512i x[S];
            for (int b = 0; b < S; ++b) x[b] = _mm512_broadcast_i64x4(load256(xq + r * k + g * G + 32 * b));
            const __m512 vx = _mm512_set1_ps(sx[r * groups + g]);
            for (int p = 0; p < NP; ++p) {
                __m512i d = _mm512_setzero_si512();
                for (int b = 0; b < S; ++b) d = dot32_pair<BITS>(d, w[p][b], x[b]);
                acc[p][r] = _mm512_fmadd_ps(_mm512_mul_ps(ws[p], vx), _mm512_cvtepi32_ps(d), acc[p][r]);
            }
        }
    }
    finish_pairs<MT, NP>(acc, groups, xsum, o, y, ldy);
}
#endif

}  // namespace
