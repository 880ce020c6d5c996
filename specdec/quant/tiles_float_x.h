// Weight-only quantized products with float32 activations: each group's codes decoded to floats once per
// tile of rows, one FMA chain per row and group, the offsets' term added at the finish.
#pragma once
#include "tiles_common.h"

namespace {

// 32 codes of one group as four vectors of 8 floats, in element order.
// int4: 16 bytes, element i in the low nibble of byte i, element 16 + i in the high nibble.
inline void decode4(const uint8_t* p, __m256* w) {
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    __m128i m = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// int8: G (32: Q5_0, Q5_K, Q8_0) signed bytes, in element order.
template <int G>
inline void decode8(const int8_t* p, __m256* w) {
    for (int v = 0; v < G / 8; ++v)
        w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * v))));
}

// One output feature j for a tile of MT rows. x: [rows, k] float32, xsum: [rows, k / G] per-group sums
// of x (for the offsets). Per group: t = sum(q * x) as 8 lanes, acc += scale * t; then a fixed
// horizontal sum, then the offsets' dot product in a fixed order.
// BITS 6 (Q6_K, G 16) decodes 128 values at a time: g0 and g1 are multiples of 8 groups there.
template <int BITS, int G, int MT>
inline void accumulate(const float* x, int64_t k, const void* codes, const float* scale, int64_t g0, int64_t g1,
                       __m256* acc) {
    const auto group = [&](const __m256* w, int64_t g) {
        const __m256 s = _mm256_broadcast_ss(scale + g);
        for (int r = 0; r < MT; ++r) {
            const float* xr = x + r * k + g * G;
            __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
            for (int v = 1; v < G / 8; ++v) t = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xr + 8 * v), t);
            acc[r] = _mm256_fmadd_ps(s, t, acc[r]);
        }
    };
    if constexpr (BITS == 6) {
        for (int64_t g = g0; g < g1; g += 8) {
            __m256i u[4];
            codes6((const uint8_t*)codes + g / 8 * 96, u);
            for (int h = 0; h < 8; ++h) {
                const __m256i v = _mm256_sub_epi8(u[h / 2], _mm256_set1_epi8(32));
                const __m128i q = h % 2 ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
                const __m256 w[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
                group(w, g + h);
            }
        }
    } else {
        for (int64_t g = g0; g < g1; ++g) {
            __m256 w[G / 8];
            if constexpr (BITS == 4) decode4((const uint8_t*)codes + g * (G / 2), w);
            else decode8<G>((const int8_t*)codes + g * G, w);
            group(w, g);
        }
    }
}

template <int BITS, int G, int MT>
inline void tile(const float* x, int64_t k, const float* xsum, const void* codes, const float* scale,
                 const float* offset, float* y, int64_t ldy) {
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    accumulate<BITS, G, MT>(x, k, codes, scale, 0, k / G, acc);
    finish<MT>(acc, k / G, xsum, offset, y, ldy);
}

// Rows whose activations do not fit the L1 cache (8 rows of k = 1,536 are 48 KB; one row of ffn_down's
// 8,960 is 35 KB), MT at a time: a tile loads each activation once per multiply-add, and from the L2
// cache it does not come fast enough. So k goes in slices of 768 values (MT rows of them, at most 24 KB,
// stay in L1), each slice over a chunk of up to 128 features (their slice of weights stays in L2)
// before the next. Each output's accumulator waits in a buffer between slices: its arithmetic is
// exactly `tile`'s, whatever the number of rows. (Zen 4: gate|up at 256 rows 0.29 -> 0.21 ms a row,
// ffn_down 0.28-0.30 -> 0.21-0.26; ffn_down verifying 5 rows 0.28-0.29 -> 0.22-0.23.)
template <int BITS, int G, int MT>
void run_sliced(const float* x, int64_t rows, int64_t k, const void* codes, const float* scale,
                const float* offset, const float* xsum, int64_t n, float* y, int64_t ldy, int threads) {
    constexpr int64_t slice = 768 / G;  // groups per slice
    const int64_t fair = (n + 2 * threads - 1) / (2 * threads);  // small n: still a chunk for every thread
    const int64_t per = fair < 8 ? 8 : fair > 128 ? 128 : fair;
    const int64_t groups = k / G, bytes = row_bytes<BITS>(k), chunks = (n + per - 1) / per;
    for (int64_t r0 = 0; r0 + MT <= rows; r0 += MT) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t ch = 0; ch < chunks; ++ch) {
            const int64_t j0 = ch * per, j1 = j0 + per < n ? j0 + per : n;
            alignas(32) float buf[128][MT][8];
            for (int64_t g0 = 0; g0 < groups; g0 += slice) {
                const int64_t g1 = g0 + slice < groups ? g0 + slice : groups;
                for (int64_t j = j0; j < j1; ++j) {
                    __m256 acc[MT];
                    for (int r = 0; r < MT; ++r) acc[r] = g0 ? _mm256_load_ps(buf[j - j0][r]) : _mm256_setzero_ps();
                    accumulate<BITS, G, MT>(x + r0 * k, k, (const uint8_t*)codes + j * bytes, scale + j * groups,
                                            g0, g1, acc);
                    if (g1 < groups) {
                        for (int r = 0; r < MT; ++r) _mm256_store_ps(buf[j - j0][r], acc[r]);
                    } else {
                        finish<MT>(acc, groups, xsum ? xsum + r0 * groups : nullptr,
                                   offset ? offset + j * groups : nullptr, y + r0 * ldy + j, ldy);
                    }
                }
            }
        }
    }
}

template <int BITS, int G>
void run(const float* x, int64_t rows, int64_t k, const void* codes, const float* scale, const float* offset,
         int64_t n, float* y, int64_t ldy, int threads) {
    const int64_t groups = k / G;
    // per-group sums of x, always in the same order: the offsets' contribution
    const std::unique_ptr<float[]> sums = offset ? group_sums<G>(x, rows, k) : nullptr;
    const float* xsum = sums.get();
    int64_t done = 0;
    if (rows >= 8) {
        run_sliced<BITS, G, 8>(x, rows, k, codes, scale, offset, xsum, n, y, ldy, threads);
        done = rows / 8 * 8;
    }
    const int64_t rest = rows - done;
    const float* xr = x + done * k;
    const float* xs = xsum ? xsum + done * groups : nullptr;
    float* yr = y + done * ldy;
    if (rest >= 2 && rest * k * 4 > 32768) {  // a verification over a large k: its rows do not fit L1 either
        simd::with_count(rest, [&](auto mt) {
            run_sliced<BITS, G, decltype(mt)::value>(xr, rest, k, codes, scale, offset, xs, n, yr, ldy, threads);
        });
    } else {
        for_each_feature<BITS, G>(n, rest, k, codes, scale, offset, threads, [&](auto mt, int64_t j, int64_t r,
                                  const void* c, const float* s, const float* o) {
            tile<BITS, G, decltype(mt)::value>(xr + r * k, k, xs ? xs + r * groups : nullptr, c, s, o,
                                               yr + r * ldy + j, ldy);
        });
    }
}

}  // namespace
