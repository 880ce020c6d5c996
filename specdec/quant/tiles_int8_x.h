// Products with int8 activations (precision int4-a8) on K-quant super-blocks (Q4_K, Q6_K): exact int32
// sums per super-block, a fixed float order, and an AVX-512 VNNI build (qlinear_vnni.cpp) with the same
// sums. Per-group scales (Q4_0, Q5_0, Q8_0, requantized drafts): tiles_group_x.h.
#pragma once
#include "tiles_common.h"

namespace {

// ---- K-quant super-blocks with int8 activations (llama.cpp's Q4_K x Q8_K, Q6_K x Q8_K) ----------------
// A Q4_K / Q6_K group's scale is d * sub with d one float per 256 values and sub a small integer, so
// with x rounded per 256 values (one dx) a whole super-block is one exact int32 sum,
// sum_g sub[g] * (codes_g . xq_g), and one float multiply-add d * dx * sum: no float work per group.
// A 256-bit vector holds two groups, one per 128-bit half; `pair_scales` gives each half its sub.
inline __m256i pair_scales(const int16_t* sub) {  // [sub[0] x 8 | sub[1] x 8] as int16
    const __m256i mask = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    int32_t both;
    __builtin_memcpy(&both, sub, 4);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(both), mask);
}

// Each row's exact int32 sums of one super-block (or part of one) into its float accumulator:
// acc += (d * dx[r]) * float(sum), dx[r * supers] the row's activation scale.
template <int MT>
inline void flush(const __m256i* sum, float d, const float* dx, int64_t supers, __m256* acc) {
    for (int r = 0; r < MT; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r * supers]), _mm256_cvtepi32_ps(sum[r]), acc[r]);
}

// Q6_K's codes go into the integer sums unsigned (0..63: vpmaddubsw / vpdpbusd take them as they are,
// no sign moved onto x per row); the -32 comes back per super-block as 32 * sum_g sub[g] * isum[g], from
// each group's integer sum of the rounded x (isums: [rows, k / 16]). Exact, and the same lanes in both builds.
template <int MT>
inline void unsigned6_correction(const int16_t* isums, int64_t k, int64_t sb, const int16_t* sub, __m256i* sum) {
    const __m256i sc = load256(sub);
    for (int r = 0; r < MT; ++r) {
        const __m256i c = _mm256_madd_epi16(load256(isums + r * (k / 16) + sb * 16), sc);
        sum[r] = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(c, 5));
    }
}

// The loop both super-block tiles share: per span of SPAN values, body(span, sum) adds each row's exact
// int32 sums of that span into sum[MT] (zeroed here), which are then flushed into the row's float
// accumulator; then the fixed horizontal sums and the offsets' dot product.
template <int MT, int SPAN, int G, class Body>
inline void span_tile(int64_t k, const float* dx, const float* dsup, const float* xsum, const float* offset,
                      float* y, int64_t ldy, Body body, const float* less = nullptr) {
    const int64_t spans = k / SPAN, supers = k / 256;
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sp = 0; sp < spans; ++sp) {
        __m256i sum[MT];
        for (int r = 0; r < MT; ++r) sum[r] = _mm256_setzero_si256();
        body(sp, sum);
        const int64_t sb = sp * SPAN / 256;
        flush<MT>(sum, dsup[sb], dx + sb, supers, acc);
    }
    finish<MT>(acc, k / G, xsum, offset, y, ldy, less);
}

// The codes a fixed distance ahead of those being read, a line at a time: features are contiguous, so
// the stream runs on into the next feature's codes (a whole feature at once overloads the queue on
// ffn_down's 4-7 KB rows).
constexpr int kPrefetchAhead = 1024;

inline void prefetch_lines(const void* p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, _MM_HINT_T0);
}

template <int BYTES>
inline void prefetch_ahead(const uint8_t* c) {
    for (int b = 0; b < BYTES; b += 64) _mm_prefetch((const char*)c + kPrefetchAhead + b, _MM_HINT_T0);
}

#ifdef __AVX512VNNI__
// 512-bit vpdpbusd over a super-block: four groups a vector. A lane sums 4 (Q6_K) or 8 (Q4_K) products,
// which fit int16, so one vpmaddwd by (sub, 0) pairs applies the groups' scales. Lanes i and i + 8 hold
// what the 256-bit path's lane i holds (groups of the same parity), so folding the halves at the end of
// the super-block gives that path's integers, hence its floats. Q4_K's x is in PAIR128 order.
constexpr XOrder SUPER_X4 = XOrder::PAIR128, SUPER_X6 = XOrder::ELEMENT;

inline __m512i quad_scales_even(const int16_t* sub) {  // 128-bit lane L: [sub[L], 0] x 4
    const __m512i mask = _mm512_set_epi8(-128, -128, 7, 6, -128, -128, 7, 6, -128, -128, 7, 6, -128, -128, 7, 6,
                                         -128, -128, 5, 4, -128, -128, 5, 4, -128, -128, 5, 4, -128, -128, 5, 4,
                                         -128, -128, 3, 2, -128, -128, 3, 2, -128, -128, 3, 2, -128, -128, 3, 2,
                                         -128, -128, 1, 0, -128, -128, 1, 0, -128, -128, 1, 0, -128, -128, 1, 0);
    int64_t four;
    __builtin_memcpy(&four, sub, 8);
    return _mm512_shuffle_epi8(_mm512_set1_epi64(four), mask);
}

// 128 Q6_K codes as two vectors of 64 unsigned codes, in element order (`codes6` with 512-bit vectors).
inline void codes6_512(const uint8_t* p, __m512i* u) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    const __m512i lo = _mm512_loadu_si512(p);
    const __m256i h = load256(p + 64);
    const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
    u[0] = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_and_si512(_mm512_slli_epi16(hi, 4), m2));
    u[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), m4), _mm512_and_si512(hi, m2));
}

inline __m512 halves(__m256 lo, __m256 hi) {  // AVX-512F only (no DQ in this build)
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// Rows 2p and 2p + 1 of a tile side by side in one 512-bit vector, 8 lanes each: their super-block sums
// folded to the 256-bit path's lanes (an integer add), converted and flushed with one instruction each,
// and the scale d * dx of each row made from a vector of both rows' dx (the same float products), so a
// pair's float work is one row's. A lone last row fills both halves; its low half is kept.
template <int MT>
struct PairFlush {
    static constexpr int P = (MT + 1) / 2;
    __m512 acc[P];

    PairFlush() {
        for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
    }

    // z: each row's sums over the super-block, lanes i and i + 8 to be added; fix(r0, r1, s) adjusts the
    // folded pair of rows r0, r1 (Q6_K's unsigned6_correction) before it is flushed with scale d * dx.
    template <class Fix>
    void flush(const __m512i* z, float d, const float* dx, int64_t supers, Fix fix) {
        const __m512 vd = _mm512_set1_ps(d);
        for (int p = 0; p < P; ++p) {
            const int r0 = 2 * p, r1 = 2 * p + 1 < MT ? 2 * p + 1 : 2 * p;
            __m512i s = _mm512_add_epi32(_mm512_shuffle_i64x2(z[r0], z[r1], 0x44),
                                         _mm512_shuffle_i64x2(z[r0], z[r1], 0xEE));
            s = fix(r0, r1, s);
            const __m512 dxp = halves(_mm256_broadcast_ss(dx + r0 * supers), _mm256_broadcast_ss(dx + r1 * supers));
            acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(vd, dxp), _mm512_cvtepi32_ps(s), acc[p]);
        }
    }

    void finish_rows(int64_t groups, const float* xsum, const float* offset, float* y, int64_t ldy,
                     const float* less) const {
        __m256 rows[MT];
        for (int r = 0; r < MT; ++r)
            rows[r] = r % 2 ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r / 2]), 1))
                            : _mm512_castps512_ps256(acc[r / 2]);
        finish<MT>(rows, groups, xsum, offset, y, ldy, less);
    }
};

// Q6_K's unsigned6_correction on a folded pair (rows r0, r1 in the low and high halves).
inline __m512i unsigned6_pair(const int16_t* isums, int64_t k, int64_t sb, const int16_t* sub, int r0, int r1,
                              __m512i s) {
    const __m512i sc = _mm512_broadcast_i64x4(load256(sub));
    const __m512i is = _mm512_inserti64x4(_mm512_castsi256_si512(load256(isums + r0 * (k / 16) + sb * 16)),
                                          load256(isums + r1 * (k / 16) + sb * 16), 1);
    return _mm512_sub_epi32(s, _mm512_slli_epi32(_mm512_madd_epi16(is, sc), 5));
}

template <int BITS, int MT>
inline void tile_super(const int8_t* xq, const float* dx, int64_t k, const float* xsum, const int16_t* isums,
                       const void* codes, const int8_t* sub, const float* dsup, const float* offset, float* y,
                       int64_t ldy, const float* less = nullptr) {
    constexpr int G = BITS == 4 ? 32 : 16;
    const int64_t supers = k / 256;
    const __m512i m = _mm512_set1_epi8(0x0F);
    PairFlush<MT> out;
    for (int64_t sb = 0; sb < supers; ++sb) {
        alignas(32) int16_t s[256 / G];
        widen_scales<256 / G>(sub + sb * (256 / G), s);
        __m512i z[MT];
        for (int r = 0; r < MT; ++r) z[r] = _mm512_setzero_si512();
        if constexpr (BITS == 4) {
            const uint8_t* c = (const uint8_t*)codes + sb * 128;
            prefetch_ahead<128>(c);
            for (int q = 0; q < 2; ++q) {  // 128 values: groups 4q .. 4q + 3
                const __m512i raw = _mm512_loadu_si512(c + 64 * q);
                const __m512i lo = _mm512_and_si512(raw, m), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m);
                const __m512i sc = quad_scales_even(s + 4 * q);  // 128-bit lane L: group 4q + L
                for (int r = 0; r < MT; ++r) {
                    const int8_t* xr = xq + r * k + sb * 256 + 128 * q;
                    const __m512i tt = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                                               _mm512_loadu_si512(xr)),
                                                           hi, _mm512_loadu_si512(xr + 64));
                    z[r] = _mm512_dpwssd_epi32(z[r], tt, sc);  // vpmaddwd + vpaddd in one, the same integers
                }
            }
        } else {
            const uint8_t* c = (const uint8_t*)codes + sb * 192;
            prefetch_ahead<192>(c);
            for (int h = 0; h < 2; ++h) {  // 128 values: groups 8h .. 8h + 7
                __m512i u[2];
                codes6_512(c + 96 * h, u);
                for (int q = 0; q < 2; ++q) {  // 64 values: groups 8h + 4q .. 8h + 4q + 3
                    const __m512i sc = quad_scales_even(s + 8 * h + 4 * q);
                    for (int r = 0; r < MT; ++r) {
                        const __m512i x = _mm512_loadu_si512(xq + r * k + sb * 256 + 128 * h + 64 * q);
                        z[r] = _mm512_dpwssd_epi32(z[r], _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[q], x), sc);
                    }
                }
            }
        }
        out.flush(z, dsup[sb], dx + sb, supers, [&](int r0, int r1, __m512i pair) {
            if constexpr (BITS == 6) return unsigned6_pair(isums, k, sb, s, r0, r1, pair);
            else return pair;
        });
    }
    out.finish_rows(k / G, xsum, offset, y, ldy, less);
}
#else
constexpr XOrder SUPER_X4 = XOrder::PAIR64, SUPER_X6 = XOrder::SPLIT64;

// The scales of 64 Q6_K values split by `split_words` (groups 4p .. 4p + 3 from s = sub + 4p): int16
// lanes [s0 s2] x 4 in the low half, [s1 s3] x 4 in the high half.
inline __m256i split_scales(const int16_t* s) {
    const __m256i mask = _mm256_setr_epi8(0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5,
                                          2, 3, 6, 7, 2, 3, 6, 7, 2, 3, 6, 7, 2, 3, 6, 7);
    int64_t four;
    __builtin_memcpy(&four, s, 8);
    return _mm256_shuffle_epi8(_mm256_set1_epi64x(four), mask);
}

// 64 values of one row: its two split runs' products added in int16 (at most 4 * 63 * 127, exact), then
// one vpmaddwd by their groups' scales. Each int32 lane sums the products it summed as 2 x 32 values
// in element order (the same groups and values), so the sums are the same integers.
inline __m256i split_dot(__m256i even, __m256i odd, const int8_t* x, __m256i sc) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(even, load256(x)),
                                              _mm256_maddubs_epi16(odd, load256(x + 32))), sc);
}

// BITS 4: G = 32, x in pair64 order; BITS 6: G = 16, x in split64 order.
template <int BITS, int MT>
inline void tile_super(const int8_t* xq, const float* dx, int64_t k, const float* xsum, const int16_t* isums,
                       const void* codes, const int8_t* sub, const float* dsup, const float* offset, float* y,
                       int64_t ldy, const float* less = nullptr) {
    constexpr int G = BITS == 4 ? 32 : 16;
    const __m256i m = _mm256_set1_epi8(0x0F);
    span_tile<MT, 256, G>(k, dx, dsup, xsum, offset, y, ldy, [&](int64_t sb, __m256i* sum) {
        alignas(32) int16_t s[256 / G];
        widen_scales<256 / G>(sub + sb * (256 / G), s);
        if constexpr (BITS == 4) {
            const uint8_t* c = (const uint8_t*)codes + sb * 128;
            prefetch_ahead<128>(c);
            for (int p = 0; p < 4; ++p) {  // 64 values: groups 2p and 2p + 1 of this super-block
                const __m256i raw = load256(c + 32 * p);
                const __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
                const __m256i sc = pair_scales(s + 2 * p);
                if constexpr (MT < 8) {
                    // both halves' products share one widening: their int16 sum is at most 4 * 15 * 127, exact
                    for (int r = 0; r < MT; ++r) {
                        const int8_t* xr = xq + r * k + sb * 256 + 64 * p;
                        const __m256i ab = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(xr)),
                                                            _mm256_maddubs_epi16(hi, load256(xr + 32)));
                        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(ab, sc));
                    }
                } else {
                    for (int r = 0; r < MT; ++r) {
                        const int8_t* xr = xq + r * k + sb * 256 + 64 * p;
                        const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(xr)), sc);
                        const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(xr + 32)), sc);
                        sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(a, b));
                    }
                }
            }
        } else {
            const uint8_t* c = (const uint8_t*)codes + sb * 192;
            prefetch_ahead<192>(c);
            for (int h = 0; h < 2; ++h) {  // 128 values: groups 8h .. 8h + 7
                __m256i u[4];
                codes6(c + 96 * h, u);
                for (int q = 0; q < 2; ++q) {  // 64 values: groups 8h + 4q .. 8h + 4q + 3
                    __m256i even, odd;
                    split_words(u[2 * q], u[2 * q + 1], &even, &odd);
                    const __m256i sc = split_scales(s + 8 * h + 4 * q);
                    const int8_t* x = xq + sb * 256 + 128 * h + 64 * q;
                    for (int r = 0; r < MT; ++r) sum[r] = _mm256_add_epi32(sum[r], split_dot(even, odd, x + r * k, sc));
                }
            }
            unsigned6_correction<MT>(isums, k, sb, s, sum);
        }
    }, less);
}

#endif

}  // namespace
