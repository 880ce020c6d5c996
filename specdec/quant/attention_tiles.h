// Attention's register tiles (attention.h): query-key products for head pairs and key blocks, the
// probabilities times the values for up to six heads, and the softmax between them. Each output element's
// float operations are the same in the AVX2 and AVX-512 builds, in the same order.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_kv.h"
#include "simd.h"

namespace {

using simd::exp8;
using simd::hsum;

// Lane j of the result: a[j]'s eight lanes summed as ((0+1)+(2+3))+((4+5)+(6+7)), whatever the other
// seven vectors hold, so a dot product's bits do not depend on what it is reduced with.
inline __m256 hsum8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The tile's products, scaled, out to s[h][0 .. NK).
template <int NH, int NK>
inline void store_scores(const __m256* acc, float scale, float* const* s) {
    const __m256 dots = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
    if constexpr (NH == 2 && NK == 4) {  // the full tile: each head's four scores are one half
        _mm_storeu_ps(s[0], _mm256_castps256_ps128(dots));
        _mm_storeu_ps(s[1], _mm256_extractf128_ps(dots, 1));
    } else {
        float out[8];
        _mm256_storeu_ps(out, dots);
        for (int h = 0; h < NH; ++h)
            for (int j = 0; j < NK; ++j) s[h][j] = out[h * NK + j];
    }
}

// s[h][j] = scale * q_h . k_j over d (a multiple of 8) for NH query heads and NK keys, NH * NK <= 8:
// one accumulator per product (eight independent chains at full size), each query and key chunk loaded
// once for the tile. Every product's arithmetic is the same whatever tile it is in.
template <int NH, int NK>
inline void qk_tile(const float* const* q, const float* const* k, int64_t d, float scale, float* const* s) {
    static_assert(NH * NK <= 8);
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        for (int h = 0; h < NH; ++h) {
            const __m256 qc = _mm256_loadu_ps(q[h] + i);
            for (int j = 0; j < NK; ++j)
                acc[h * NK + j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[j] + i), acc[h * NK + j]);
        }
    store_scores<NH, NK>(acc, scale, s);
}

// The full tile, two heads by four keys, as qk_tile<2, 4> computes it, each key chunk loaded once into
// a register for both heads.
template <>
inline void qk_tile<2, 4>(const float* const* q, const float* const* k, int64_t d, float scale, float* const* s) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
    for (int64_t i = 0; i < d; i += 8) {
        __m256 a = _mm256_loadu_ps(k0 + i), b = _mm256_loadu_ps(k1 + i), c = _mm256_loadu_ps(k2 + i),
               e = _mm256_loadu_ps(k3 + i);
        __asm__("" : "+x"(a), "+x"(b), "+x"(c), "+x"(e));  // loaded once: else each FMA reloads its key
        for (int h = 0; h < 2; ++h) {
            const __m256 qc = _mm256_loadu_ps(q[h] + i);
            acc[4 * h] = _mm256_fmadd_ps(qc, a, acc[4 * h]);
            acc[4 * h + 1] = _mm256_fmadd_ps(qc, b, acc[4 * h + 1]);
            acc[4 * h + 2] = _mm256_fmadd_ps(qc, c, acc[4 * h + 2]);
            acc[4 * h + 3] = _mm256_fmadd_ps(qc, e, acc[4 * h + 3]);
        }
    }
    store_scores<2, 4>(acc, scale, s);
}

#ifdef __AVX512F__
// Head pairs' queries side by side, [pairs][d / 8][16]: pair p's chunk i is q_2p[8i, 8i + 8) then q_2p+1's.
inline void pair_queries(const float* qh, int64_t pairs, int64_t d, float* out) {
    for (int64_t p = 0; p < pairs; ++p)
        for (int64_t i = 0; i < d; i += 8) {
            memcpy(out + 2 * (p * d + i), qh + 2 * p * d + i, 32);
            memcpy(out + 2 * (p * d + i) + 8, qh + (2 * p + 1) * d + i, 32);
        }
}

// _mm256_hadd_ps on each 256-bit half: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] a 128-bit lane.
inline __m512 hadd16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// store_scores<2, 4> of a pair's four keys, acc[j] holding hsum8's a[j] (head 0) and a[4 + j] (head 1)
// in its halves: the same tree of additions (hsum8's hadds, a half at a time, then its halves' sum), in
// 16-float vectors. s0, s1: the two heads' four scores.
inline void store_pair_scores(const __m512* acc, float scale, float* s0, float* s1) {
    const __m512 u = hadd16(hadd16(acc[0], acc[1]), hadd16(acc[2], acc[3]));  // [u0 | u1] of hsum8
    const __m512 dots = _mm512_mul_ps(_mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0xB1)), _mm512_set1_ps(scale));
    _mm_storeu_ps(s0, _mm512_castps512_ps128(dots));
    _mm_storeu_ps(s1, _mm512_extractf32x4_ps(dots, 2));
}

// qk_tile<2, 4> for NP head pairs at once (qp[p]: a pair's pair_queries, of any row) and keys t .. t + 3, a
// pair's two products with one key in the two halves of a 16-float vector: each product's multiply-adds
// and sum are qk_tile<2, 4>'s, and each key chunk is loaded once for all 2 * NP heads. s[2p], s[2p + 1]:
// pair p's heads' four scores.
template <int NP, class Rows>
inline void qk_pairs16(const float* const* qp, const Rows& keys, int64_t t, int64_t d, float scale,
                       float* const* s) {
    __m512 acc[NP][4];
    for (int p = 0; p < NP; ++p)
        for (int j = 0; j < 4; ++j) acc[p][j] = _mm512_setzero_ps();
    const auto* k0 = row_at(keys, t);
    decltype(k0) k[4] = {k0, row_at(keys, t + 1), row_at(keys, t + 2), row_at(keys, t + 3)};
    for (int64_t i = 0; i < d; i += 8) {
        __m512 kc[4];
        for (int j = 0; j < 4; ++j) kc[j] = both8(k[j] + i);  // keys t .. t + 3, the chunk in both halves
        for (int p = 0; p < NP; ++p) {
            const __m512 qc = _mm512_loadu_ps(qp[p] + 2 * i);
            for (int j = 0; j < 4; ++j) acc[p][j] = _mm512_fmadd_ps(qc, kc[j], acc[p][j]);
        }
    }
    for (int p = 0; p < NP; ++p) store_pair_scores(acc[p], scale, s[2 * p], s[2 * p + 1]);
}
#endif

// acc_h[0 .. 8W) += sum over t in [t0, t1), in order, of p_h[t] * v_t[0 .. 8W) for NH query heads h,
// v_t = v.row(t) + i0 (KvRows): the accumulators stay in registers over the block, and each chunk of a
// value row is loaded once for the NH heads. ahead: ask for the same values kAhead rows on (KvSource).
template <int NH, int W, class Rows>
inline void pv_tile(const float* const* p, const Rows& v, int64_t i0, int64_t t0, int64_t t1, float* const* acc,
                    bool ahead) {
    __m256 r[NH][W];
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) r[h][w] = _mm256_loadu_ps(acc[h] + i0 + 8 * w);
    for (int64_t t = t0; t < t1; ++t) {
        const float* vt = v.row(t) + i0;
        if (ahead) v.ahead(t, i0 * sizeof(*v.cache));
        __m256 vc[W];
        for (int w = 0; w < W; ++w) vc[w] = _mm256_loadu_ps(vt + 8 * w);
        for (int h = 0; h < NH; ++h) {
            const __m256 pt = _mm256_broadcast_ss(p[h] + t);
            for (int w = 0; w < W; ++w) r[h][w] = _mm256_fmadd_ps(pt, vc[w], r[h][w]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc[h] + i0 + 8 * w, r[h][w]);
}

#ifdef __AVX512F__
// pv_tile in 16-float vectors: each output element's multiply-adds are pv_tile's, in the same order.
// Up to six heads by four vectors (64 values of a row) stay in the 32 registers. rows[t - t0]: value row
// t as row_at gives it.
template <int NH, int W, class Rows, class E>
inline void pv_tile16(const float* const* p, const Rows& v, const E* const* rows, int64_t i0, int64_t t0, int64_t t1,
                      float* const* acc, bool ahead) {
    __m512 r[NH][W];
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) r[h][w] = _mm512_loadu_ps(acc[h] + i0 + 16 * w);
    const int64_t bytes = sizeof(*v.cache);  // the cache's element: ahead() asks for the source row's lines
    for (int64_t t = t0; t < t1; ++t) {
        if (ahead)
            for (int64_t b = i0 * bytes; b < (i0 + 16 * W) * bytes; b += 64) v.ahead(t, b);
        const E* vt = rows[t - t0] + i0;
        __m512 vc[W];
        for (int w = 0; w < W; ++w) vc[w] = load16(vt + 16 * w);
        for (int h = 0; h < NH; ++h) {
            const __m512 pt = _mm512_set1_ps(p[h][t]);
            for (int w = 0; w < W; ++w) r[h][w] = _mm512_fmadd_ps(pt, vc[w], r[h][w]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) _mm512_storeu_ps(acc[h] + i0 + 16 * w, r[h][w]);
}
#endif

// Softmax in place over s[0, len): the maximum subtracted, the exponentials summed in a fixed order,
// then each divided by the sum.
inline void softmax_(float* s, int64_t len) {
    const float m = simd::largest(s, len);
    const __m256 m8 = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t t = 0;
#ifdef __AVX512F__
    for (const __m512 m16 = _mm512_set1_ps(m); t + 16 <= len; t += 16) {  // the sum as two steps of 8
        const __m512 e = simd::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m16));
        _mm512_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
        sum8 = _mm256_add_ps(sum8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; t + 8 <= len; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
        _mm256_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    if (t < len) {  // the last 1-7 scores, padded
        float tail[8];
        for (int u = 0; u < 8; ++u) tail[u] = t + u < len ? s[t + u] - m : -INFINITY;
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        for (int64_t u = t; u < len; ++u) { s[u] = tail[u - t]; sum += s[u]; }
    }
    const __m256 inv = _mm256_set1_ps(sum);
    t = 0;
#ifdef __AVX512F__
    for (const __m512 inv16 = _mm512_set1_ps(sum); t + 16 <= len; t += 16)
        _mm512_storeu_ps(s + t, _mm512_div_ps(_mm512_loadu_ps(s + t), inv16));
#endif
    for (; t + 8 <= len; t += 8) _mm256_storeu_ps(s + t, _mm256_div_ps(_mm256_loadu_ps(s + t), inv));
    for (; t < len; ++t) s[t] /= sum;
}

}  // namespace
