// A requantized draft's codes per group of 64 (q4_64, q3_64: a float16 scale and offset a group) under
// int8 activations on row-interleaved tiles, as tiles_rows16.h reads Q4_K: 16 output features side by
// side, one feature a 32-bit lane, a group's products for all 16 one vpdpbusd per 4 values (x broadcast).
// Each (row, feature, group) gets S = codes_g . xq_g, exact, then in this order acc = fmadd(scale * dx, S,
// acc) and acc = fmadd(offset, xsum, acc), xsum being dx times the group's integer sum of xq. Any vector
// width computes the same integers and these float operations per lane, so AVX2 == VNNI bitwise and a
// row's result does not depend on the rows or features beside it.
//
// A tile (`pack_tiles64` in qlinear.cpp): per 16 features and group of 64 values, kRows64Bytes[BITS] bytes:
//   scale [16] float16, offset [16] float16 (the requantizer fits float16 values: requantize.py)
//   4 bits: codes [2 halves][4 runs][16 features][4] uint8   byte of run i, value j in half h: codes
//                                                            32h + 4i + j (low nibble), 32h + 16 + 4i + j (high)
//   3 bits: pairs [4][16 features][4] uint8                  bits 2i, 2i + 1 of vector v: run 4v + i's low
//                                                            bits (run R: values 4R .. 4R + 3)
//           thirds [2][16 features][4] uint8                 bit b of vector w: run 8w + b's third bit
#pragma once
#include "tiles_rows16.h"

namespace {

constexpr int64_t kRows64Bytes[5] = {0, 0, 0, 448, 576};  // by bits
constexpr int kScale64At = 0, kOffset64At = 32, kCodes64At = 64, kThirds64At = 64 + 256;

#ifdef __AVX512VNNI__
using Vec = __m512i;
inline Vec load_vec(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Vec and_(Vec a, Vec b) { return _mm512_and_si512(a, b); }
inline Vec bytes_of(int8_t b) { return _mm512_set1_epi8(b); }
inline Vec shr16(Vec a, int n) { return _mm512_srli_epi16(a, n); }
inline Vec shl16(Vec a, int n) { return _mm512_slli_epi16(a, n); }
inline Vec low_or_top(Vec low, Vec m, Vec top) { return _mm512_ternarylogic_epi32(low, m, top, 0xEA); }
constexpr int kLanes = 16;
#else
using Vec = __m256i;
inline Vec load_vec(const uint8_t* p) { return load256(p); }
inline Vec and_(Vec a, Vec b) { return _mm256_and_si256(a, b); }
inline Vec bytes_of(int8_t b) { return _mm256_set1_epi8(b); }
inline Vec shr16(Vec a, int n) { return _mm256_srli_epi16(a, n); }
inline Vec shl16(Vec a, int n) { return _mm256_slli_epi16(a, n); }
inline Vec low_or_top(Vec low, Vec m, Vec top) { return _mm256_or_si256(_mm256_and_si256(low, m), top); }
constexpr int kLanes = 8;
#endif

// Runs 8 * half .. 8 * half + 7 of a group (values 32 * half ..) as unsigned codes, features [lanes * h,
// lanes * h + lanes) of the tile t (h: which part of the 64-byte rows a vector holds).
template <int BITS>
inline void runs64(const uint8_t* t, int half, int h, Vec* u) {
    const int at = 4 * kLanes * h;
    if constexpr (BITS == 4) {
        const Vec m4 = bytes_of(0x0F);
        for (int i = 0; i < 4; ++i) {
            const Vec raw = load_vec(t + kCodes64At + 256 * half + 64 * i + at);
            u[i] = and_(raw, m4);
            u[4 + i] = and_(shr16(raw, 4), m4);
        }
    } else {
        const Vec m3 = bytes_of(3), m4 = bytes_of(4), third = load_vec(t + kThirds64At + 64 * half + at);
        for (int b = 0; b < 8; ++b) {  // run 8 * half + b: its pair in vector 2 * half + b / 4, its third at bit b
            const Vec pairs = load_vec(t + kCodes64At + 64 * (2 * half + b / 4) + at);
            const Vec low = b % 4 ? shr16(pairs, 2 * (b % 4)) : pairs;
            // bit b to bit 2 by a 16-bit shift: what crosses from the next byte lands above bit 2, masked off
            const Vec top = b < 2 ? shl16(third, 2 - b) : b > 2 ? shr16(third, b - 2) : third;
            u[b] = low_or_top(low, m3, and_(top, m4));
        }
    }
}

#ifdef __AVX512VNNI__
// MT rows through one tile column (16 features, every group); lanes [lo, hi) of each row written to y.
template <int BITS, int MT>
inline void rows16_g64(const int8_t* xq, const float* dx, const float* xs, int64_t k, const uint8_t* t, float* y,
                       int64_t ldy, int lo, int hi) {
    constexpr int64_t bytes = kRows64Bytes[BITS];
    const int64_t groups = k / 64;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, t += bytes) {
        prefetch_lines(t + 6 * bytes, bytes);  // 3-4 KB ahead into L1 (a group is short),
        prefetch_l2(t + 10 * bytes, bytes);    // 5-6 KB into L2
        __m512i s[MT];
        for (int r = 0; r < MT; ++r) s[r] = zero;
        for (int half = 0; half < 2; ++half) {
            __m512i u[8];
            runs64<BITS>(t, half, 0, u);
            // a row's half-group as two independent chains, joined exactly
            for (int r = 0; r < MT; ++r) {
                const int8_t* x = xq + r * k + 64 * g + 32 * half;
                __m512i a = zero, b = zero;
                for (int i = 0; i < 4; ++i) {
                    a = dpbusd_at(a, u[i], x + 4 * i);
                    b = dpbusd_at(b, u[4 + i], x + 16 + 4 * i);
                }
                s[r] = _mm512_add_epi32(s[r], _mm512_add_epi32(a, b));
            }
        }
        const __m512 sc = _mm512_cvtph_ps(load256(t + kScale64At)), of = _mm512_cvtph_ps(load256(t + kOffset64At));
        for (int r = 0; r < MT; ++r) {
            const __m512 dd = _mm512_mul_ps(sc, _mm512_set1_ps(dx[r * groups + g]));
            acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s[r]), acc[r]);
            acc[r] = _mm512_fmadd_ps(of, _mm512_set1_ps(xs[r * groups + g]), acc[r]);
        }
    }
    const __mmask16 keep = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
    for (int r = 0; r < MT; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}
#else
// The same integers and floats, 8 features a pass (half h of the tile): a half-group's eight vpmaddubsw
// words per lane stay within int16 (8 * 2 * 15 * 127 = 30480), one vpmaddwd by ones widens them.
template <int BITS, int MT>
inline void rows16_g64_half(const int8_t* xq, const float* dx, const float* xs, int64_t k, const uint8_t* t, float* y,
                            int64_t ldy, int h, int lo, int hi) {
    constexpr int64_t bytes = kRows64Bytes[BITS];
    const int64_t groups = k / 64;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, t += bytes) {
        prefetch_lines(t + 6 * bytes, bytes);
        prefetch_l2(t + 10 * bytes, bytes);
        __m256i s[MT];
        for (int r = 0; r < MT; ++r) s[r] = _mm256_setzero_si256();
        for (int half = 0; half < 2; ++half) {
            __m256i u[8];
            runs64<BITS>(t, half, h, u);
            for (int r = 0; r < MT; ++r) {
                const int8_t* x = xq + r * k + 64 * g + 32 * half;
                __m256i w = _mm256_setzero_si256();
                for (int i = 0; i < 4; ++i) {
                    w = _mm256_add_epi16(w, dot4(u[i], x + 4 * i));
                    w = _mm256_add_epi16(w, dot4(u[4 + i], x + 16 + 4 * i));
                }
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(w, ones));
            }
        }
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + kScale64At + 16 * h)));
        const __m256 of = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + kOffset64At + 16 * h)));
        for (int r = 0; r < MT; ++r) {
            const __m256 dd = _mm256_mul_ps(sc, _mm256_set1_ps(dx[r * groups + g]));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(of, _mm256_set1_ps(xs[r * groups + g]), acc[r]);
        }
    }
    store_half<MT>(acc, y, ldy, h, lo, hi);
}

// MT rows through one tile column: the halves holding lanes [lo, hi).
template <int BITS, int MT>
inline void rows16_g64(const int8_t* xq, const float* dx, const float* xs, int64_t k, const uint8_t* t, float* y,
                       int64_t ldy, int lo, int hi) {
    for (int h = 0; h < 2; ++h)
        if (lo < 8 * h + 8 && hi > 8 * h) rows16_g64_half<BITS, MT>(xq, dx, xs, k, t, y, ldy, h, lo, hi);
}
#endif

}  // namespace
