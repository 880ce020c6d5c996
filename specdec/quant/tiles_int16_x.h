#pragma once
#include "tiles_int8_x.h"

namespace {

// ---- K-quant super-blocks with int16 activations (precision int4-a16) -----------------------------------
// The same integer sums as the int8 super-blocks (tiles_int8_x.h), with x rounded to int16 per 256 values (dx = max|x| / 32767): 256 times
// finer than int8, so close to float32's results, while the multiply-adds stay integer (vpmaddwd, 16
// products an instruction) instead of a float conversion and a float FMA per 8 weights. Each code is
// widened to int16 and multiplied by its group's integer scale (|q * sub| <= 15 * 63 for Q4_K, 32 * 128
// for Q6_K: int16). An int32 lane then takes 32 (Q4_K) or 16 (Q6_K) products of at most 945 * 32767 or
// 4096 * 32767 before it goes to float: 256 and 128 values per flush, below 2^31. Integer sums are exact
// x comes rounded by quantize_rows16 (quantize_x.h).
template <int BITS, int MT>
inline void tile_a16(const int16_t* xq, const float* dx, int64_t k, const float* xsum, const void* codes,
                     const int8_t* sub, const float* dsup, const float* offset, float* y, int64_t ldy) {
    constexpr int G = BITS == 4 ? 32 : 16, SPAN = BITS == 4 ? 256 : 128;  // values per int32 flush
#ifdef __AVX512VNNI__
    // 512-bit vpdpwssd: 32 products an instruction, twice the 256-bit form's throughput here. A span's
    // sums go to 16 lanes; lane i + 8 holds exactly the products the 8-lane path puts in lane i with
    // lane i's (a group's first half and second half, or two groups), so folding the halves at the
    // span's end gives the 8-lane path's integers, hence its floats.
    const __m512i m = _mm512_set1_epi16(0x0F);
    span_tile<MT, SPAN, G>(k, dx, dsup, xsum, offset, y, ldy, [&](int64_t sp, __m256i* sum) {
        alignas(16) int16_t s[SPAN / G];
        widen_scales<SPAN / G>(sub + sp * (SPAN / G), s);
        const int16_t* xs = xq + sp * SPAN;
        __m512i z[MT];
        for (int r = 0; r < MT; ++r) z[r] = _mm512_setzero_si512();
        const auto rows = [&](__m512i w, int64_t at) {  // w: 32 weights times scales; at: their first value
            for (int r = 0; r < MT; ++r) z[r] = _mm512_dpwssd_epi32(z[r], w, _mm512_loadu_si512(xs + r * k + at));
        };
        if constexpr (BITS == 4) {
            for (int g = 0; g < 8; ++g) {  // one group: its 16 bytes as elements 0-15 (low nibbles), 16-31 (high)
                const __m256i b = _mm256_cvtepu8_epi16(
                    _mm_loadu_si128((const __m128i*)((const uint8_t*)codes + sp * 128 + 16 * g)));
                const __m512i bb = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
                rows(_mm512_mullo_epi16(_mm512_and_si512(bb, m), _mm512_set1_epi16(s[g])), 32 * g);
            }
        } else {
            __m256i u[4];  // one span: 128 values, groups of 16
            codes6((const uint8_t*)codes + sp * 96, u);
            for (int g = 0; g < 8; g += 2) {  // two groups of 16
                const __m512i q = _mm512_cvtepi8_epi16(_mm256_sub_epi8(u[g / 2], _mm256_set1_epi8(32)));
                const __m512i sc = _mm512_inserti64x4(_mm512_set1_epi16(s[g]), _mm256_set1_epi16(s[g + 1]), 1);
                rows(_mm512_mullo_epi16(q, sc), 16 * g);
            }
        }
        for (int r = 0; r < MT; ++r)
            sum[r] = _mm256_add_epi32(_mm512_castsi512_si256(z[r]), _mm512_extracti64x4_epi64(z[r], 1));
    });
#else
    const __m256i m = _mm256_set1_epi16(0x0F);
    span_tile<MT, SPAN, G>(k, dx, dsup, xsum, offset, y, ldy, [&](int64_t sp, __m256i* sum) {
        alignas(16) int16_t s[SPAN / G];
        widen_scales<SPAN / G>(sub + sp * (SPAN / G), s);
        const int16_t* xs = xq + sp * SPAN;
        if constexpr (BITS == 4) {
            const uint8_t* c = (const uint8_t*)codes + sp * 128;
            for (int g = 0; g < 8; ++g) {  // byte i: element i (low nibble), element 16 + i (high nibble)
                const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(c + 16 * g)));
                const __m256i sc = _mm256_set1_epi16(s[g]);
                const __m256i lo = _mm256_mullo_epi16(_mm256_and_si256(b, m), sc);
                const __m256i hi = _mm256_mullo_epi16(_mm256_srli_epi16(b, 4), sc);
                for (int r = 0; r < MT; ++r) {
                    const int16_t* xr = xs + r * k + 32 * g;
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(lo, load256(xr)),
                                                                       _mm256_madd_epi16(hi, load256(xr + 16))));
                }
            }
        } else {
            __m256i u[4];  // one span: 128 values, groups of 16
            codes6((const uint8_t*)codes + sp * 96, u);
            for (int g = 0; g < 8; ++g) {
                const __m256i v = _mm256_sub_epi8(u[g / 2], _mm256_set1_epi8(32));
                const __m256i q =
                    _mm256_cvtepi8_epi16(g % 2 ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v));
                const __m256i w = _mm256_mullo_epi16(q, _mm256_set1_epi16(s[g]));
                for (int r = 0; r < MT; ++r)
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(w, load256(xs + r * k + 16 * g)));
            }
        }
    });
#endif
}

// Q4_K's offsets -dmin * m under int4-a8 as integers: per super-block, dmin * dx * sum_g m[g] * isum[g]
// (isum: the group's integer sum of the rounded x; m: the file's 6-bit minimum). Exact in int32, one
// float operation per super-block, and a byte per 32 weights read instead of a float32 offset. Two
// super-blocks (16 groups) a vector; an odd last one in scalar integers.
inline float min_dot(const int16_t* isum, const uint8_t* m, const float* dmin, const float* dx, int64_t supers) {
    __m256 acc = _mm256_setzero_ps();
    int64_t sb = 0;
    for (; sb + 2 <= supers; sb += 2) {
        const __m256i p = _mm256_madd_epi16(load256(isum + 8 * sb),
                                            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(m + 8 * sb))));
        const __m256 s = _mm256_set_m128(_mm_set1_ps(dmin[sb + 1] * dx[sb + 1]), _mm_set1_ps(dmin[sb] * dx[sb]));
        acc = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), acc);
    }
    float tail = 0.f;
    if (sb < supers) {
        int32_t t = 0;
        for (int g = 0; g < 8; ++g) t += (int32_t)isum[8 * sb + g] * m[8 * sb + g];
        tail = dmin[sb] * dx[sb] * (float)t;
    }
    return hsum(acc) + tail;
}

// min_dot of 8 features at once, one a lane: feature f's minimums at m + f * groups, its dmin at
// dmin + f * supers; `rows` rows (row i's isum at isum + i * groups, its dx at dx + i * supers) into
// out[i * 8 + f]; k up to kMins8Supers super-blocks. Each lane takes min_dot's integers and float
// operations in min_dot's order (its 8 accumulator lanes are 8 vectors here, its horizontal sum their
// fixed tree), so the results are the same; the minimums are transposed once for the rows, and each
// float operation serves 8 features.
constexpr int64_t kMins8Supers = 64;  // k up to 16,384

inline void min_dot8(const int16_t* isum, int64_t groups, const float* dx, int64_t supers, const uint8_t* m,
                     const float* dmin, int64_t rows, float* out) {
    __m256i w[kMins8Supers][4];  // super-block sb, its group pair l: 8 features' two minimums as int16
    __m256 dm[kMins8Supers];
    const __m256i stride =
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)supers));
    for (int64_t sb = 0; sb < supers; ++sb) {
        __m128i q[4];  // features 2i and 2i + 1: their 8 minimums of sb each
        for (int i = 0; i < 4; ++i)
            q[i] = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(m + 2 * i * groups + 8 * sb)),
                                      _mm_loadl_epi64((const __m128i*)(m + (2 * i + 1) * groups + 8 * sb)));
        // a 16-bit word is a group pair's two minimums: transpose 8 features x 4 pairs
        const __m128i t0 = _mm_unpacklo_epi16(q[0], q[1]), t1 = _mm_unpackhi_epi16(q[0], q[1]);
        const __m128i t2 = _mm_unpacklo_epi16(q[2], q[3]), t3 = _mm_unpackhi_epi16(q[2], q[3]);
        const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
        const __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
        const __m128i pair[4] = {_mm_unpacklo_epi64(u0, u2), _mm_unpackhi_epi64(u0, u2), _mm_unpacklo_epi64(u1, u3),
                                 _mm_unpackhi_epi64(u1, u3)};
        for (int l = 0; l < 4; ++l) w[sb][l] = _mm256_cvtepu8_epi16(pair[l]);
        dm[sb] = _mm256_i32gather_ps(dmin + sb, stride, 4);
    }
    for (int64_t i = 0; i < rows; ++i) {
        const int16_t* is = isum + i * groups;
        const float* d = dx + i * supers;
        const auto pair = [&](int64_t sb, int l) {  // each feature's m . isum over group pair l of sb
            int32_t two;
            __builtin_memcpy(&two, is + 8 * sb + 2 * l, 4);
            return _mm256_madd_epi16(w[sb][l], _mm256_set1_epi32(two));
        };
        __m256 acc[8];  // min_dot's lane l of each feature
        for (int l = 0; l < 8; ++l) acc[l] = _mm256_setzero_ps();
        int64_t sb = 0;
        for (; sb + 2 <= supers; sb += 2)  // sb into lanes 0-3, sb + 1 into lanes 4-7
            for (int h = 0; h < 2; ++h) {
                const __m256 s = _mm256_mul_ps(dm[sb + h], _mm256_set1_ps(d[sb + h]));
                for (int l = 0; l < 4; ++l)
                    acc[4 * h + l] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(pair(sb + h, l)), acc[4 * h + l]);
            }
        __m256 tail = _mm256_setzero_ps();
        if (sb < supers) {
            __m256i t = _mm256_setzero_si256();
            for (int l = 0; l < 4; ++l) t = _mm256_add_epi32(t, pair(sb, l));
            tail = _mm256_mul_ps(_mm256_mul_ps(dm[sb], _mm256_set1_ps(d[sb])), _mm256_cvtepi32_ps(t));
        }
        // hsum's tree: (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 + l7), then their sum
        const __m256 h0 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
        const __m256 h1 = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
        _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_add_ps(h0, h1), tail));
    }
}

}  // namespace
