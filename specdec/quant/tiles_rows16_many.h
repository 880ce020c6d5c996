// Multi-row products on the row-interleaved Q4_K tiles (tiles_rows16.h), AVX-512 VNNI: every row of a
// verification (or of a prompt's span) through a tile column in one pass, each group's codes decoded
// once for all of them. The register tiles of tiles_rows16.h hold up to 12 rows' sums in registers and
// decode the codes again for each tile of rows; past 12 rows this kernel keeps each row's running sums in
// memory instead (a load and a store beside every scale multiply, on ports the multiply-adds do not use)
// and runs two rows' chains side by side. Each row's integers and its two float operations a super-block
// are those of rows16: the same bits for any row count.
#pragma once
#include "tiles_rows16.h"

namespace {

#ifdef __AVX512VNNI__
constexpr int kManyRows = 32;  // rows of one pass, at most

// codes . (the 4 bytes at x, in every lane) from zero: the zeroing idiom in the same asm, so that the
// compiler does not copy a zero register into each chain (a move the vector ports would execute).
inline __m512i dpbusd_new(__m512i codes, const int8_t* x) {
    __m512i acc;
    __asm__("vpxord %0, %0, %0\n\tvpdpbusd %2%{1to16%}, %1, %0" : "=&v"(acc) : "v"(codes), "m"(*(const word32*)x));
    return acc;
}

// x_row . codes over 4 runs of 4 values (u), from zero.
inline __m512i runs_dot(const __m512i* u, const int8_t* x) {
    __m512i h = dpbusd_new(u[0], x);
    for (int i = 1; i < 4; ++i) h = dpbusd_at(h, u[i], x + 4 * i);
    return h;
}

// Q4_K: rows16_q4k for `rows` rows (at most kManyRows); lanes [lo, hi) written.
inline void many_q4k(const int8_t* xq, const float* dx, const int16_t* xs, int64_t k, const uint8_t* t, float* y,
                     int64_t ldy, int lo, int hi, int rows) {
    const int64_t supers = k / 256, groups = k / 32;
    __m512 acc[kManyRows];
    __m512i s[kManyRows];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < supers; ++sb, t += kRows16Bytes) {
        const __m512 d = _mm512_cvtph_ps(load256(t + kDAt)), dm = _mm512_cvtph_ps(load256(t + kDminAt));
        __m512i mp[4];
        for (int p = 0; p < 4; ++p) mp[p] = _mm512_cvtepu8_epi16(load256(t + kMinsAt + 32 * p));
        for (int r = 0; r < rows; ++r) {
            acc[r] = q4k_minus_mins(acc[r], mp, xs + r * groups + sb * 8, dm, dx[r * supers + sb]);
            s[r] = _mm512_setzero_si512();
        }
        for (int g = 0; g < 8; ++g) {
            prefetch_group(t, kRows16Bytes, g);
            __m512i low[4], high[4];
            q4k_runs(t + kCodesAt + 256 * g, low, high);
            const __m512i sc = q4k_scale(t, g);
            const int8_t* x = xq + sb * 256 + 32 * g;
            int r = 0;
            for (; r + 2 <= rows; r += 2) {  // rows16's half-group order: low half, then high, a row at a time
                const int8_t *x0 = x + r * k, *x1 = x0 + k;
                const __m512i a0 = runs_dot(low, x0), a1 = runs_dot(low, x1);
                const __m512i b0 = runs_dot(high, x0 + 16), b1 = runs_dot(high, x1 + 16);
                s[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s[r], a0, sc), b0, sc);
                s[r + 1] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s[r + 1], a1, sc), b1, sc);
            }
            if (r < rows)
                s[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(s[r], runs_dot(low, x + r * k), sc),
                                           runs_dot(high, x + r * k + 16), sc);
        }
        for (int r = 0; r < rows; ++r) acc[r] = flush(acc[r], d, dx[r * supers + sb], s[r]);
    }
    store_lanes(acc, rows, y, ldy, lo, hi);
}

// Rows [0, rows) of Q4_K through one tile column, kManyRows at a time. (Q6_K stays in register tiles:
// two vpdpwssd for every four vpdpbusd, each a load and a store of a running sum here, ran 1.2x slower.)
inline void rows16_many(const int8_t* xq, const float* dx, const int16_t* xs, int64_t k, const uint8_t* t, float* y,
                        int64_t ldy, int lo, int hi, int64_t rows) {
    const int64_t supers = k / 256, groups = k / 32;
    for (int64_t r = 0; r < rows; r += kManyRows) {
        const int n = (int)std::min<int64_t>(kManyRows, rows - r);
        many_q4k(xq + r * k, dx + r * supers, xs + r * groups, k, t, y + r * ldy, ldy, lo, hi, n);
    }
}
#endif

}  // namespace
