// Linear layers for x86 CPUs, y[r, j] = sum_k x[r, k] * w[j, k]: the kernels themselves, included by two
// translation units. qlinear.cpp builds them for AVX2 (every x86-64 CPU the package supports) and holds
// the C entry points; qlinear_vnni.cpp builds the integer-activation paths again with AVX-512 VNNI, whose
// dot-product instructions replace two or three AVX2 instructions each (`#ifdef __AVX512VNNI__` below).
// Both compute the same exact integer sums and the same float operations in the same order, so they are
// bitwise equal: which one runs depends only on the CPU (kernel_isa), never on the batch.
//
// Weight-only quantized: w is stored
// per group of G input values as integer codes q with a float scale and an optional float offset:
// w = scale * q + offset (exactly how GGUF's Q4_K / Q5_0 / Q6_K / Q8_0 blocks decode). Dense float32
// weights (precision float32) at the end.
//
// Batch invariance by construction: every output element is reduced in the same order whatever the
// number of rows, so a token's result never depends on what else shares the forward. Rows are
// processed in tiles so that each group's codes are decoded once per tile, not once per row.
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <memory>
#include <type_traits>

#include "simd.h"

namespace {

using simd::hsum;

// The offsets' contribution: sum over groups of offset[g] * (sum of x over group g), in a fixed order.
inline float offset_dot(const float* offset, const float* xs, int64_t groups) {
    __m256 o = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) o = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g), _mm256_loadu_ps(xs + g), o);
    float tail = 0.f;
    for (; g < groups; ++g) tail += offset[g] * xs[g];
    return hsum(o) + tail;
}

// A buffer of n values, left uninitialized (std::make_unique would zero it: one more pass over up to
// rows * k values that the kernels overwrite anyway), freed with its owner.
template <class T>
std::unique_ptr<T[]> buffer(int64_t n) {
    return std::unique_ptr<T[]>(new T[n]);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// N (8 or 16) integer group scales, int8 as held (a byte per 16 or 32 weights read), widened to the
// int16 the tiles multiply by: once per super-block (or span) and feature, whatever the rows.
template <int N>
inline void widen_scales(const int8_t* sub, int16_t* s) {
    if constexpr (N == 8) _mm_store_si128((__m128i*)s, _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)sub)));
    else _mm256_store_si256((__m256i*)s, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sub)));
}

// Bytes of one row of codes: k values of BITS bits.
template <int BITS>
constexpr int64_t row_bytes(int64_t k) { return k * BITS / 8; }

// 128 Q6_K codes (`pack6` in packed.py: 64 bytes of low nibbles, then 32 of high bit pairs) as four
// vectors of 32 unsigned codes 0..63 in element order: the file's bits, three instructions a vector.
inline void codes6(const uint8_t* p, __m256i* u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i lo0 = load256(p), lo1 = load256(p + 32), hi = load256(p + 64);
    u[0] = _mm256_or_si256(_mm256_and_si256(lo0, m4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), m2));
    u[1] = _mm256_or_si256(_mm256_and_si256(lo1, m4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), m2));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), m4), _mm256_and_si256(hi, m2));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(hi, 2), m2));
}

// Per-group sums of x, [rows, k / G].
template <int G>
std::unique_ptr<float[]> group_sums(const float* x, int64_t rows, int64_t k) {
    const int64_t groups = k / G;
    std::unique_ptr<float[]> xsum = buffer<float>(rows * groups);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            __m256 a = _mm256_loadu_ps(x + r * k + g * G);
            for (int v = 1; v < G / 8; ++v) a = _mm256_add_ps(a, _mm256_loadu_ps(x + r * k + g * G + 8 * v));
            xsum[r * groups + g] = hsum(a);
        }
    return xsum;
}

// Output features are handed out in chunks on demand, not split evenly up front: when another process
// takes a core, the thread that keeps its core does more of the work instead of waiting at the end.
inline int chunk_size(int64_t n, int threads) {
    int64_t c = n / (threads * 16);
    return (int)(c < 8 ? 8 : c);
}

// Rows per pass over the weights: enough that their activations (about 256 KB of float32) stay in the
// L2 cache while every feature reads them. With all rows in one pass, each feature re-read every row
// from L3 (1.5 MB for 256 rows of 1,536), so a 256-row prefill cost more per row than 64 rows.
inline int64_t row_block(int64_t k) {
    const int64_t b = (65536 / k) / 8 * 8;
    return b < 8 ? 8 : b;
}

// tile(MT, r) for rows [r0, r1) in tiles of 8, then the remaining 1-7 rows as one tile (a group's codes
// are decoded once per tile; MT arrives as std::integral_constant).
template <class Tile>
inline void row_tiles(int64_t r0, int64_t r1, Tile tile) {
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) tile(std::integral_constant<int, 8>{}, r);
    // the rest as one tile: k + 1 = 2..8 verification rows decode each group once
    simd::with_count(r1 - r, [&](auto mt) { tile(mt, r); });
}

// Runs feature(j, r0, r1) over every output feature j in [0, n) (in parallel), for rows in blocks of
// `row_block` (a multiple of 8, so row_tiles' tiles are the same whatever the block: each output's
// arithmetic never depends on the blocking).
template <class Feature>
void parallel_features(int64_t n, int64_t rows, int64_t k, int threads, Feature feature) {
    const int64_t block = row_block(k);
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t r1 = r0 + block < rows ? r0 + block : rows;
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk_size(n, threads))
        for (int64_t j = 0; j < n; ++j) feature(j, r0, r1);
    }
}

// Runs tile(MT, j, r, codes, scale, offset) over every output feature j and its rows (row_tiles).
template <int BITS, int G, class Tile>
void for_each_feature(int64_t n, int64_t rows, int64_t k, const void* codes, const float* scale,
                      const float* offset, int threads, Tile tile) {
    const int64_t groups = k / G, bytes = row_bytes<BITS>(k);
    parallel_features(n, rows, k, threads, [&](int64_t j, int64_t r0, int64_t r1) {
        const uint8_t* c = (const uint8_t*)codes + j * bytes;
        const float* s = scale + j * groups;
        const float* o = offset ? offset + j * groups : nullptr;
        row_tiles(r0, r1, [&](auto mt, int64_t r) { tile(mt, j, r, c, s, o); });
    });
}

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

template <int MT>
inline void finish(const __m256* acc, int64_t groups, const float* xsum, const float* offset, float* y, int64_t ldy) {
    for (int r = 0; r < MT; ++r)
        y[r * ldy] = hsum(acc[r]) + (offset ? offset_dot(offset, xsum + r * groups, groups) : 0.f);
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

// ---- int8 activations (precision int4-a8): x quantized per 32 values, integer dot products ----------
// x row r, group g ~= sx[r, g] * xq[r, g, :] (round to nearest, |xq| <= 127). Per group the dot product
// of codes and xq is exact in int32 (vpmaddubsw + vpmaddwd); the float accumulation order is fixed.

inline __m256i codes4(const uint8_t* p) {  // 32 unsigned codes, element order
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

inline __m256 dot32(__m256i w, __m256i xq, bool is_signed) {
    // vpmaddubsw takes unsigned x signed bytes: a signed w moves its sign onto x
    __m256i u = is_signed ? _mm256_sign_epi8(w, w) : w;
    __m256i v = is_signed ? _mm256_sign_epi8(xq, w) : xq;
#ifdef __AVX512VNNI__
    __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else  // pairs of products are at most 2 * 127 * 127: vpmaddubsw never saturates, so both are exact
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
    return _mm256_cvtepi32_ps(p);  // 8 lanes: 4 consecutive values each
}

template <int BITS, int G, int MT>
inline void tile_a8(const int8_t* xq, const float* sx, int64_t k, const float* xsum, const void* codes,
                    const float* scale, const float* offset, float* y, int64_t ldy) {
    const int64_t blocks = k / 32;  // activation groups
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i w = BITS == 4 ? codes4((const uint8_t*)codes + b * 16)
                              : _mm256_loadu_si256((const __m256i*)((const int8_t*)codes + b * 32));
        const __m256 ws = _mm256_broadcast_ss(scale + b);  // one group of 32 (Q6_K's groups of 16: tile_super)
        for (int r = 0; r < MT; ++r) {
            __m256i x = _mm256_loadu_si256((const __m256i*)(xq + r * k + b * 32));
            __m256 d = dot32(w, x, BITS == 8);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws, _mm256_broadcast_ss(sx + r * blocks + b)), d, acc[r]);
        }
    }
    finish<MT>(acc, k / G, xsum, offset, y, ldy);
}

// max |x| over n values (a multiple of 8).
inline float abs_max(const float* x, int n) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + i), abs));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// Where value i of a block goes in the rounded x. PAIR64: each 64 values are stored as [group 2c elements
// 0-15, group 2c+1 elements 0-15, then both groups' elements 16-31]: the order in which one 32-byte load
// of two int4 groups' codes yields its nibbles. PAIR128: two such 64-value runs interleaved by halves
// [run 0 first half, run 1 first half, run 0 second half, run 1 second half]: the order of one 64-byte
// load's nibbles.
enum class XOrder { ELEMENT, PAIR64, PAIR128 };

inline int x_position(int i, XOrder order) {
    if (order == XOrder::ELEMENT) return i;
    const int e = i % 64, pos64 = (e % 32) / 16 * 32 + e / 32 * 16 + e % 16;
    if (order == XOrder::PAIR64) return (i - e) + pos64;
    const int run = (i % 128) / 64;
    return (i - i % 128) + pos64 / 32 * 64 + run * 32 + pos64 % 32;
}

// x rounded to int8 per `block` values: x ~= dx[r, b] * xq[r, b, :], dx = max|x| / 127 (round to nearest),
// stored in `order`. With xsum ([rows, k / G]), also each group's sum of the rounded values, dx times an
// exact integer sum: the offsets (Q4_K's -dmin * m, Q4_0's -8d) then multiply the same x as the codes, so a
// product is w . x_rounded (llama.cpp's bsums). With the unrounded sums instead, the rounding error was
// weighted by the unsigned codes s * q, several times the centred weights (docs/cpu-kernels.md).
// With isums ([rows, k / G] int16), each group's exact integer sum of the rounded values (for Q6_K's
// unsigned codes, `unsigned6_correction`).
template <int G>
void quantize_rows(const float* x, int64_t rows, int64_t k, int block, XOrder order, int8_t* xq, float* dx,
                   float* xsum, int16_t* isums = nullptr) {
    const int64_t blocks = k / block;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* xb = x + r * k + b * block;
            int8_t* qb = xq + r * k + b * block;
            const float d = abs_max(xb, block) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            dx[r * blocks + b] = d;
            const __m256 vid = _mm256_set1_ps(id);
            for (int g = 0; g < block / G; ++g) {
                __m256i sum = _mm256_setzero_si256();
                // 16 values at a time: every XOrder moves runs of 16 whole (round to nearest even, as nearbyint)
                for (int i = g * G; i < (g + 1) * G; i += 16) {
                    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
                    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
                    sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, c));
                    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);  // 16 int16 in order
                    _mm_storeu_si128((__m128i*)(qb + x_position(i, order)),
                                     _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
                }
                const int32_t isum = hsum_epi32(sum);
                if (xsum) xsum[(r * k + b * block) / G + g] = d * (float)isum;
                if (isums) isums[(r * k + b * block) / G + g] = (int16_t)isum;
            }
        }
}

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

// The codes a fixed distance ahead of those being read, a line at a time: features are contiguous, so
// the stream runs on into the next feature's codes (a whole feature at once overloads the queue on
// ffn_down's 4-7 KB rows).
constexpr int kPrefetchAhead = 1024;

template <int BYTES>
inline void prefetch_ahead(const uint8_t* c) {
    for (int b = 0; b < BYTES; b += 64) _mm_prefetch((const char*)c + kPrefetchAhead + b, _MM_HINT_T0);
}

#ifdef __AVX512VNNI__
// 512-bit vpdpbusd over a super-block: four groups a vector. A lane sums 4 (Q6_K) or 8 (Q4_K) products,
// which fit int16, so one vpmaddwd by (sub, 0) pairs applies the groups' scales. Lanes i and i + 8 hold
// what the 256-bit path's lane i holds (groups of the same parity), so folding the halves at the end of
// the super-block gives that path's integers, hence its floats. Q4_K's x is in PAIR128 order.
constexpr XOrder SUPER_X4 = XOrder::PAIR128;

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

template <int BITS, int MT>
inline void tile_super(const int8_t* xq, const float* dx, int64_t k, const float* xsum, const int16_t* isums,
                       const void* codes, const int8_t* sub, const float* dsup, const float* offset, float* y,
                       int64_t ldy) {
    constexpr int G = BITS == 4 ? 32 : 16;
    const __m512i m = _mm512_set1_epi8(0x0F);
    span_tile<MT, 256, G>(k, dx, dsup, xsum, offset, y, ldy, [&](int64_t sb, __m256i* sum) {
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
                    z[r] = _mm512_add_epi32(z[r], _mm512_madd_epi16(tt, sc));
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
                        z[r] = _mm512_add_epi32(z[r], _mm512_madd_epi16(
                                                          _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[q], x), sc));
                    }
                }
            }
        }
        for (int r = 0; r < MT; ++r)
            sum[r] = _mm256_add_epi32(_mm512_castsi512_si256(z[r]), _mm512_extracti64x4_epi64(z[r], 1));
        if constexpr (BITS == 6) unsigned6_correction<MT>(isums, k, sb, s, sum);
    });
}
#else
constexpr XOrder SUPER_X4 = XOrder::PAIR64;

// BITS 4: G = 32, x in pair64 order; BITS 6: G = 16, element order.
template <int BITS, int MT>
inline void tile_super(const int8_t* xq, const float* dx, int64_t k, const float* xsum, const int16_t* isums,
                       const void* codes, const int8_t* sub, const float* dsup, const float* offset, float* y,
                       int64_t ldy) {
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
                for (int p = 0; p < 4; ++p) {  // 32 values: groups 8h + 2p and 8h + 2p + 1
                    const __m256i sc = pair_scales(s + 8 * h + 2 * p);
                    for (int r = 0; r < MT; ++r) {
                        const __m256i x = load256(xq + r * k + sb * 256 + 128 * h + 32 * p);
                        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[p], x), sc));
                    }
                }
            }
            unsigned6_correction<MT>(isums, k, sb, s, sum);
        }
    });
}

#endif

// ---- K-quant super-blocks with int16 activations (precision int4-a16) -----------------------------------
// The same integer sums as above, with x rounded to int16 per 256 values (dx = max|x| / 32767): 256 times
// finer than int8, so close to float32's results, while the multiply-adds stay integer (vpmaddwd, 16
// products an instruction) instead of a float conversion and a float FMA per 8 weights. Each code is
// widened to int16 and multiplied by its group's integer scale (|q * sub| <= 15 * 63 for Q4_K, 32 * 128
// for Q6_K: int16). An int32 lane then takes 32 (Q4_K) or 16 (Q6_K) products of at most 945 * 32767 or
// 4096 * 32767 before it goes to float: 256 and 128 values per flush, below 2^31. Integer sums are exact
// in any order and the float accumulation runs over k in order: batch-invariant.
void quantize_rows16(const float* x, int64_t rows, int64_t k, int16_t* xq, float* dx) {
    const int64_t blocks = k / 256;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const float* xb = x + r * k + b * 256;
            int16_t* qb = xq + r * k + b * 256;
            const float d = abs_max(xb, 256) / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
            dx[r * blocks + b] = d;
            const __m256 vid = _mm256_set1_ps(id);
            for (int i = 0; i < 256; i += 16) {  // round to nearest even, as nearbyint
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
                const __m256i b2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
                // packs works per 128-bit lane: put the halves back in order
                _mm256_storeu_si256((__m256i*)(qb + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b2), 0xD8));
            }
        }
}

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

// ---- dense float32 weights (precision float32 on CPU) ------------------------------------------------
// A tile of MT rows x NF output features: each weight vector is loaded once for MT rows and each x vector
// once for NF features (12 FMAs per 7 loads at 4 x 3), which is what makes many rows cheaper per row
// than MKL's sgemm here. Each output keeps one 8-lane accumulator over k in order, then a fixed
// horizontal sum: the same arithmetic whatever the tile, so rows are batch-invariant by construction.
template <int MT, int NF>
inline void dense_tile(const float* x, int64_t k, const float* w, float* y, int64_t ldy) {
    __m256 acc[MT][NF];
    for (int r = 0; r < MT; ++r)
        for (int f = 0; f < NF; ++f) acc[r][f] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 wv[NF];
        for (int f = 0; f < NF; ++f) wv[f] = _mm256_loadu_ps(w + f * k + i);
        for (int r = 0; r < MT; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + r * k + i);
            for (int f = 0; f < NF; ++f) acc[r][f] = _mm256_fmadd_ps(wv[f], xv, acc[r][f]);
        }
    }
    for (int r = 0; r < MT; ++r)
        for (int f = 0; f < NF; ++f) y[r * ldy + f] = hsum(acc[r][f]);
}

template <int NF>
inline void dense_rows(const float* x, int64_t rows, int64_t k, const float* w, float* y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) dense_tile<4, NF>(x + r * k, k, w, y + r * ldy, ldy);
    for (; r < rows; ++r) dense_tile<1, NF>(x + r * k, k, w, y + r * ldy, ldy);
}

void dense(const float* x, int64_t rows, int64_t k, const float* w, int64_t n, float* y, int64_t ldy,
           int threads) {
    constexpr int NF = 3;
    const int64_t blocks = (n + NF - 1) / NF;
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk_size(blocks, threads) / 2)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j = b * NF;
        if (j + NF <= n) dense_rows<NF>(x, rows, k, w + j * k, y + j, ldy);
        else
            for (int64_t jj = j; jj < n; ++jj) dense_rows<1>(x, rows, k, w + jj * k, y + jj, ldy);
    }
}

}  // namespace

