// Q4_K under int8 activations on row-interleaved tiles: 16 output features side by side, one feature a
// 32-bit lane, so a group's products for all 16 are one vpdpbusd per 4 values (x broadcast) and the
// super-block's sum is one exact int32 a lane, with no horizontal sums. Each (row, feature, super-block)
// gets S = sum_g sub[g] * (codes_g . xq_g) and M = sum_g m[g] * (sum of xq_g), exact; then, in this order,
// acc = fnmadd(dmin * dx, M, acc) and acc = fmadd(d * dx, S, acc). Any vector width computes the same
// integers and these two float operations per lane, so AVX2 == VNNI bitwise and a row's result does not
// depend on the rows or features beside it.
//
// Q6_K the same way: S = sum_g sub[g] * ((codes_g - 32) . xq_g), then acc = fmadd(d * dx, S, acc). Under
// VNNI each half-group's chain starts at its x offset, -32 * (sum of its 8 xq), so that it ends at
// (codes - 32) . xq, within int16 (8 * 32 * 127 = 32512): one vpdpwssd by (sub, 0) pairs applies the
// group's scale, where an 18-bit group sum took a vpmulld (two operations) and an add.
//
// A Q4_K tile (`pack_tiles16` in qlinear.cpp): per 16 features and super-block, kRows16Bytes bytes:
//   sub   [8 groups][16 features] uint8            the 6-bit group scales
//   mins  [4 pairs][16 features][2] uint8          the 6-bit minimums, groups 2p and 2p + 1 side by side
//   d     [16] float16, dmin [16] float16          the file's super-block scales
//   codes [8 groups][4 runs][16 features][4] uint8 byte of run i, value j: codes 4i + j (low nibble)
//                                                  and 16 + 4i + j (high nibble) of the group
// A Q6_K tile: per 16 features and super-block, kRows16Bytes6 bytes:
//   sub   [8 pairs][16 features][2] int8           the group scales, groups 2p and 2p + 1 side by side
//   d     [16] float16
//   codes [8 pairs][6][16 features][4] uint8       per pair of groups (32 values, runs of 4): four vectors of
//                                                  low nibbles (run i's: group 2p's in the low nibble, 2p + 1's
//                                                  in the high), then each group's top bit pairs (run i's at
//                                                  bits 2i, 2i + 1)
#pragma once
#include <type_traits>

#include "tiles_common.h"

namespace {

constexpr int64_t kRows16Bytes = 2368;
constexpr int kSubAt = 0, kMinsAt = 128, kDAt = 256, kDminAt = 288, kCodesAt = 320;
constexpr int64_t kRows16Bytes6 = 3360;
constexpr int kD6At = 256, kCodes6At = 288;

// Where the VNNI build differs from AVX2's. What each row of x brings beside its codes (Rows16Reader):
// Q4_K its group sums (int16, k / 32); Q6_K under VNNI its offsets (int32, k / 8: q6k_offsets), under
// AVX2 its group sums (int16, k / 16). Rows of one register tile: 9-12 rows ran 1.1-1.3x faster as one
// AVX-512 tile (32 registers) than in tiles_rows16_many.h's one pass, whose running sums live in memory;
// AVX2's 16 registers hold 8.
#ifdef __AVX512VNNI__
constexpr bool kQ6Offsets = true;
constexpr int kRows16Tile = 12;
#else
constexpr bool kQ6Offsets = false;
constexpr int kRows16Tile = 8;
#endif
template <int BITS>
using Rows16Sum = std::conditional_t<BITS == 6 && kQ6Offsets, int32_t, int16_t>;
template <int BITS>
constexpr int64_t rows16_sums(int64_t k) { return BITS == 4 ? k / 32 : kQ6Offsets ? k / 8 : k / 16; }

// 32 bits at any address, read so that a broadcast of it folds into its instruction's memory operand
typedef int32_t __attribute__((may_alias, aligned(1))) word32;
inline int32_t load_pair(const int16_t* p) { return *(const word32*)p; }  // two int16 (low: p[0])
inline int32_t load_quad(const int8_t* p) { return *(const word32*)p; }

#ifdef __AVX512VNNI__
// acc + codes . (the 4 bytes at x, in every lane), the broadcast inside vpdpbusd's memory operand: GCC
// 12 loads it into a register first, an instruction more per product that held the front end back.
inline __m512i dpbusd_at(__m512i acc, __m512i codes, const int8_t* x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const word32*)x));
    return acc;
}

// What rows16_q4k / rows16_q6k and their one-pass forms (tiles_rows16_many.h) compute alike, per row and
// super-block, so that both give the same bits.

// Q4_K: acc - dmin * dx * M, M = sum_g m[g] * (sum of xq_g) (x: the row's 8 group sums of the super-block,
// mp: its minimums widened to int16 pairs).
inline __m512 q4k_minus_mins(__m512 acc, const __m512i* mp, const int16_t* x, __m512 dm, float dx) {
    __m512i m = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) m = _mm512_dpwssd_epi32(m, mp[p], _mm512_set1_epi32(load_pair(x + 2 * p)));
    return _mm512_fnmadd_ps(_mm512_mul_ps(dm, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(m), acc);
}

// Q4_K group g's four runs of codes (c: the group's 256 bytes), low nibbles and high.
inline void q4k_runs(const uint8_t* c, __m512i* low, __m512i* high) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
        const __m512i raw = _mm512_loadu_si512(c + 64 * i);
        low[i] = _mm512_and_si512(raw, m4);
        high[i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
}

// Q4_K group g's scale as (sub, 0) int16 pairs: a half-group's sum (16 products, |.| <= 30480) fits the
// low word.
inline __m512i q4k_scale(const uint8_t* t, int g) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(t + kSubAt + 16 * g)));
}

// x's offsets for Q6_K under VNNI: -32 * (sum of each run of 8 xq), n / 8 of them (n a multiple of 32).
inline void q6k_offsets(const int8_t* xq, int64_t n, int32_t* o) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    alignas(32) int64_t sums[4];
    for (int64_t i = 0; i < n; i += 32, o += 4) {
        // vpsadbw sums 8 unsigned bytes a lane: the bytes as xq + 128 sum to (sum of xq) + 1024
        _mm256_store_si256((__m256i*)sums, _mm256_sad_epu8(_mm256_xor_si256(load256(xq + i), flip), zero));
        for (int j = 0; j < 4; ++j) o[j] = -32 * ((int32_t)sums[j] - 1024);
    }
}

// Q6_K group 2p + odd's scale as (sub, 0) int16 pairs: the zero word meets a half-group sum's sign.
inline __m512i q6k_scale(const uint8_t* t, int p, int odd) {
    const __m512i sw = _mm512_cvtepi8_epi16(load256(t + 32 * p));  // (sub[2p], sub[2p + 1]) a lane
    return odd ? _mm512_srli_epi32(sw, 16) : _mm512_and_si512(sw, _mm512_set1_epi32(0xFFFF));
}

// (codes - 32) . xq over half a group (runs u[0], u[1]: the 8 values at x), from the offset at o.
inline __m512i q6k_half(const __m512i* u, const int8_t* x, const int32_t* o) {
    return dpbusd_at(dpbusd_at(_mm512_set1_epi32(*o), u[0], x), u[1], x + 4);
}

// The super-block's flush: acc + d * dx * S.
inline __m512 flush(__m512 acc, __m512 d, float dx, __m512i s) {
    return _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(s), acc);
}

// Lanes [lo, hi) of each of n rows' accumulators to y (the tile's first feature).
inline void store_lanes(const __m512* acc, int n, float* y, int64_t ldy, int lo, int hi) {
    const __mmask16 keep = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
    for (int r = 0; r < n; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

// MT rows through one tile column (16 features, every super-block); lanes [lo, hi) of each row written
// to y (the tile's first feature).
template <int MT>
inline void rows16_q4k(const int8_t* xq, const float* dx, const int16_t* xs, int64_t k, const uint8_t* t, float* y,
                       int64_t ldy, int lo, int hi) {
    const int64_t supers = k / 256, groups = k / 32;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < supers; ++sb, t += kRows16Bytes) {
        const __m512 d = _mm512_cvtph_ps(load256(t + kDAt)), dm = _mm512_cvtph_ps(load256(t + kDminAt));
        __m512i mp[4];
        for (int p = 0; p < 4; ++p) mp[p] = _mm512_cvtepu8_epi16(load256(t + kMinsAt + 32 * p));
        for (int r = 0; r < MT; ++r) acc[r] = q4k_minus_mins(acc[r], mp, xs + r * groups + sb * 8, dm, dx[r * supers + sb]);
        __m512i s[MT];
        for (int r = 0; r < MT; ++r) s[r] = zero;
        for (int g = 0; g < 8; ++g) {
            prefetch_group(t, kRows16Bytes, g);
            __m512i low[4], high[4];
            q4k_runs(t + kCodesAt + 256 * g, low, high);
            const __m512i sc = q4k_scale(t, g);
            // each half-group a row at a time, the rows' chains interleaved (independent neighbours)
            const int8_t* x = xq + sb * 256 + 32 * g;
            for (int half = 0; half < 2; ++half) {
                __m512i h[MT];
                for (int r = 0; r < MT; ++r) h[r] = zero;
                for (int i = 0; i < 4; ++i)
                    for (int r = 0; r < MT; ++r)
                        h[r] = dpbusd_at(h[r], half ? high[i] : low[i], x + r * k + 16 * half + 4 * i);
                for (int r = 0; r < MT; ++r) s[r] = _mm512_dpwssd_epi32(s[r], h[r], sc);
            }
        }
        for (int r = 0; r < MT; ++r) acc[r] = flush(acc[r], d, dx[r * supers + sb], s[r]);
    }
    store_lanes(acc, MT, y, ldy, lo, hi);
}
// Group 2p + odd's four runs of 4 values (c: its pair's codes) as unsigned bytes 0..63.
inline void runs6(const uint8_t* c, int odd, __m512i* u) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i top = _mm512_loadu_si512(c + 256 + 64 * odd);
    const __m512i tops[4] = {_mm512_slli_epi16(top, 4), _mm512_slli_epi16(top, 2), top, _mm512_srli_epi16(top, 2)};
    for (int i = 0; i < 4; ++i) {
        const __m512i l = _mm512_loadu_si512(c + 64 * i);
        // (low nibble & 0x0F) | (top bits & 0x30)
        const __m512i top_i = _mm512_and_si512(tops[i], m30);
        u[i] = _mm512_ternarylogic_epi32(odd ? _mm512_srli_epi16(l, 4) : l, m4, top_i, 0xEA);
    }
}

// xo: x's offsets (q6k_offsets), k / 8 a row.
template <int MT>
inline void rows16_q6k(const int8_t* xq, const float* dx, const int32_t* xo, int64_t k, const uint8_t* t, float* y,
                       int64_t ldy, int lo, int hi) {
    const int64_t supers = k / 256, offsets = k / 8;
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < supers; ++sb, t += kRows16Bytes6) {
        __m512i s[MT];
        for (int r = 0; r < MT; ++r) s[r] = _mm512_setzero_si512();
        for (int p = 0; p < 8; ++p) {
            prefetch_group(t, kRows16Bytes6, p);
            for (int odd = 0; odd < 2; ++odd) {
                __m512i u[4];
                runs6(t + kCodes6At + 384 * p, odd, u);
                const __m512i sc = q6k_scale(t, p, odd);
                const int64_t at = sb * 256 + 32 * p + 16 * odd;
                for (int r = 0; r < MT; ++r) {
                    const int8_t* x = xq + r * k + at;
                    const int32_t* o = xo + r * offsets + at / 8;
                    s[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s[r], q6k_half(u, x, o), sc),
                                               q6k_half(u + 2, x + 8, o + 1), sc);
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(load256(t + kD6At));
        for (int r = 0; r < MT; ++r) acc[r] = flush(acc[r], d, dx[r * supers + sb], s[r]);
    }
    store_lanes(acc, MT, y, ldy, lo, hi);
}

// MT rows through one tile column of Q4_K (BITS 4) or Q6_K (BITS 6), lanes [lo, hi) written.
// xs: x's sums as Rows16Sum<BITS> (rows16_sums) says.
template <int BITS, int MT, class Sum>
inline void rows16(const int8_t* xq, const float* dx, const Sum* xs, int64_t k, const uint8_t* t, float* y,
                   int64_t ldy, int lo, int hi) {
    if constexpr (BITS == 4) rows16_q4k<MT>(xq, dx, xs, k, t, y, ldy, lo, hi);
    else rows16_q6k<MT>(xq, dx, xs, k, t, y, ldy, lo, hi);
}
#else
// codes . (the 4 bytes at x, in every lane) as two int16 words a lane (vpmaddubsw: two products each)
inline __m256i dot4(__m256i codes, const int8_t* x) {
    return _mm256_maddubs_epi16(codes, _mm256_set1_epi32(load_quad(x)));
}

// Lanes [lo, hi) of the tile's 16, those of half h (features 8h .. 8h + 7), from each row's acc.
template <int MT>
inline void store_half(const __m256* acc, float* y, int64_t ldy, int h, int lo, int hi) {
    const int a = lo > 8 * h ? lo - 8 * h : 0, b = hi < 8 * h + 8 ? hi - 8 * h : 8;
    alignas(32) int32_t mask[8];
    for (int i = 0; i < 8; ++i) mask[i] = i >= a && i < b ? -1 : 0;
    const __m256i keep = _mm256_load_si256((const __m256i*)mask);
    for (int r = 0; r < MT; ++r) _mm256_maskstore_ps(y + r * ldy + 8 * h, keep, acc[r]);
}

// The same integers and floats, 8 features a pass (half h of the tile): a word of vpmaddubsw sums two
// products (|.| <= 3810) and a group's eight such words per lane stay within int16 (30480), so one
// vpmaddwd by (sub, sub) pairs gives sub * (codes_g . xq_g) in each feature's lane.
template <int MT>
inline void rows16_q4k_half(const int8_t* xq, const float* dx, const int16_t* xs, int64_t k, const uint8_t* t,
                            float* y, int64_t ldy, int h, int lo, int hi) {
    const int64_t supers = k / 256, groups = k / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < supers; ++sb, t += kRows16Bytes) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + kDAt + 16 * h)));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + kDminAt + 16 * h)));
        __m256i mp[4];
        for (int p = 0; p < 4; ++p)
            mp[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(t + kMinsAt + 32 * p + 16 * h)));
        for (int r = 0; r < MT; ++r) {
            const int16_t* x = xs + r * groups + sb * 8;
            __m256i m = _mm256_setzero_si256();
            for (int p = 0; p < 4; ++p)
                m = _mm256_add_epi32(m, _mm256_madd_epi16(mp[p], _mm256_set1_epi32(load_pair(x + 2 * p))));
            const __m256 dmx = _mm256_mul_ps(dm, _mm256_set1_ps(dx[r * supers + sb]));
            acc[r] = _mm256_fnmadd_ps(dmx, _mm256_cvtepi32_ps(m), acc[r]);
        }
        __m256i s[MT];
        for (int r = 0; r < MT; ++r) s[r] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
            prefetch_group(t, kRows16Bytes, g);
            const uint8_t* c = t + kCodesAt + 256 * g + 32 * h;
            __m256i low[4], high[4];
            for (int i = 0; i < 4; ++i) {
                const __m256i raw = load256(c + 64 * i);
                low[i] = _mm256_and_si256(raw, m4);
                high[i] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
            const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(t + kSubAt + 16 * g + 8 * h)));
            const __m256i sc = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
            for (int r = 0; r < MT; ++r) {
                const int8_t* x = xq + r * k + sb * 256 + 32 * g;
                __m256i w = _mm256_setzero_si256();
                for (int i = 0; i < 4; ++i) {
                    w = _mm256_add_epi16(w, dot4(low[i], x + 4 * i));
                    w = _mm256_add_epi16(w, dot4(high[i], x + 16 + 4 * i));
                }
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(w, sc));
            }
        }
        for (int r = 0; r < MT; ++r) {
            const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * supers + sb]));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s[r]), acc[r]);
        }
    }
    store_half<MT>(acc, y, ldy, h, lo, hi);
}

// Q6_K's integers 8 features a pass: two vpmaddubsw words (4 products, |.| <= 32004) stay within int16,
// and vpmaddwd by (sub, sub) pairs gives sub * (those products) in each feature's lane.
inline void runs6_half(const uint8_t* c, int odd, __m256i* u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i top = load256(c + 256 + 64 * odd);
    const __m256i tops[4] = {_mm256_slli_epi16(top, 4), _mm256_slli_epi16(top, 2), top, _mm256_srli_epi16(top, 2)};
    for (int i = 0; i < 4; ++i) {
        const __m256i l = load256(c + 64 * i);
        u[i] = _mm256_or_si256(_mm256_and_si256(odd ? _mm256_srli_epi16(l, 4) : l, m4), _mm256_and_si256(tops[i], m30));
    }
}

template <int MT>
inline void rows16_q6k_half(const int8_t* xq, const float* dx, const int16_t* xs, int64_t k, const uint8_t* t,
                            float* y, int64_t ldy, int h, int lo, int hi) {
    const int64_t supers = k / 256, groups = k / 16;
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < supers; ++sb, t += kRows16Bytes6) {
        __m256i s[MT];
        for (int r = 0; r < MT; ++r) {  // S starts at -32 * sum_g sub[g] * (sum of xq_g)
            const int16_t* x = xs + r * groups + sb * 16;
            __m256i c = _mm256_setzero_si256();
            for (int p = 0; p < 8; ++p) {
                const __m256i sw = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(t + 32 * p + 16 * h)));
                c = _mm256_add_epi32(c, _mm256_madd_epi16(sw, _mm256_set1_epi32(load_pair(x + 2 * p))));
            }
            s[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(c, 5));
        }
        for (int p = 0; p < 8; ++p) {
            prefetch_group(t, kRows16Bytes6, p);
            for (int odd = 0; odd < 2; ++odd) {
                __m256i u[4];
                runs6_half(t + kCodes6At + 384 * p + 32 * h, odd, u);
                const __m256i sw = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(t + 32 * p + 16 * h)));
                const __m256i s32 = odd ? _mm256_srai_epi32(sw, 16) : _mm256_srai_epi32(_mm256_slli_epi32(sw, 16), 16);
                const __m256i sc = _mm256_blend_epi16(s32, _mm256_slli_epi32(s32, 16), 0xAA);  // (sub, sub)
                const int8_t* x = xq + sb * 256 + 32 * p + 16 * odd;
                for (int r = 0; r < MT; ++r) {
                    const int8_t* xr = x + r * k;
                    const __m256i w01 = _mm256_add_epi16(dot4(u[0], xr), dot4(u[1], xr + 4));
                    const __m256i w23 = _mm256_add_epi16(dot4(u[2], xr + 8), dot4(u[3], xr + 12));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(w01, sc));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(w23, sc));
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + kD6At + 16 * h)));
        for (int r = 0; r < MT; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * supers + sb])), _mm256_cvtepi32_ps(s[r]),
                                     acc[r]);
    }
    store_half<MT>(acc, y, ldy, h, lo, hi);
}

// MT rows through one tile column of Q4_K (BITS 4) or Q6_K (BITS 6): the halves holding lanes [lo, hi).
template <int BITS, int MT, class Sum>
inline void rows16(const int8_t* xq, const float* dx, const Sum* xs, int64_t k, const uint8_t* t, float* y,
                   int64_t ldy, int lo, int hi) {
    for (int h = 0; h < 2; ++h) {
        if (lo >= 8 * h + 8 || hi <= 8 * h) continue;
        if constexpr (BITS == 4) rows16_q4k_half<MT>(xq, dx, xs, k, t, y, ldy, h, lo, hi);
        else rows16_q6k_half<MT>(xq, dx, xs, k, t, y, ldy, h, lo, hi);
    }
}
#endif

}  // namespace
