#pragma once
#include "tiles_common.h"

namespace {

// Each row's exact int32 sums of one super-block (or part of one) into its float accumulator:
// acc += (d * dx[r]) * float(sum), dx[r * supers] the row's activation scale.
template <int MT>
inline void flush(const __m256i* sum, float d, const float* dx, int64_t supers, __m256* acc) {
    for (int r = 0; r < MT; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r * supers]), _mm256_cvtepi32_ps(sum[r]), acc[r]);
}

// tile_a16's loop: per span of SPAN values, body(span, sum) adds each row's exact int32 sums of that
// span into sum[MT] (zeroed here), which are then flushed into the row's float accumulator; then the
// fixed horizontal sums and the offsets' dot product.
template <int MT, int SPAN, int G, class Body>
inline void span_tile(int64_t k, const float* dx, const float* dsup, const float* xsum, const float* offset,
                      float* y, int64_t ldy, Body body) {
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
    finish<MT>(acc, k / G, xsum, offset, y, ldy);
}

// ---- K-quant super-blocks with int16 activations (precision int4-a16) -----------------------------------
// Integer sums per span with x rounded to int16 per 256 values (dx = max|x| / 32767): 256 times
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

}  // namespace
