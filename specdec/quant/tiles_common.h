// What every linear-layer kernel shares: small vector helpers, the group-sum and offset terms, the
// finish of an output (a fixed horizontal sum), and how work is split: output features handed to threads
// in chunks on demand, rows in blocks that stay in L2 and in tiles of up to 8 that decode each group's
// codes once (qlinear.h says what invariance this keeps).
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

// Two vectors of 32 bytes a, b (2-byte words a_w, b_w) as [a_0 b_0 a_2 b_2 ... a_14 b_14] and
// [a_1 b_1 a_3 b_3 ... a_15 b_15]: applied to two runs of Q6_K codes and to their x alike, each int16
// lane of the two products holds words of one group, so one vpmaddwd applies the scales of both
// (tile_super<6>). Two instructions a vector.
inline void split_words(__m256i a, __m256i b, __m256i* even, __m256i* odd) {
    *even = _mm256_blend_epi16(a, _mm256_slli_epi32(b, 16), 0xAA);
    *odd = _mm256_blend_epi16(_mm256_srli_epi32(a, 16), b, 0xAA);
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
// `per_thread` chunks a thread on average: fewer and longer on the integer paths, whose tiles prefetch
// the features after their own (a chunk's end is a stream's restart).
inline int chunk_size(int64_t n, int threads, int per_thread = 16) {
    int64_t c = n / (threads * per_thread);
    return (int)(c < 8 ? 8 : c);
}

// Rows per pass over the weights: enough that their activations (about 256 KB, `bytes` a value) stay in
// the L2 cache while every feature reads them. With all rows in one pass, each feature re-read every row
// from L3 (1.5 MB for 256 float32 rows of 1,536), so a 256-row prefill cost more per row than 64 rows.
// Integer x counts its own width: 17 verification rows of ffn_down as bytes take one pass, not three.
inline int64_t row_block(int64_t k, int64_t bytes = 4) {
    const int64_t b = (262144 / (k * bytes)) / 8 * 8;
    return b < 8 ? 8 : b;
}

// tile(MT, r) for rows [r0, r1) in tiles of T (at most 8), then the remaining rows as one tile (a group's
// codes are decoded once per tile; MT arrives as std::integral_constant). A row's result never depends on
// its tile: a tile computes each of its rows alone, in the same order.
template <int T = 8, class Tile>
inline void row_tiles(int64_t r0, int64_t r1, Tile tile) {
    static_assert(T >= 1 && T <= 8);
    int64_t r = r0;
    for (; r + T <= r1; r += T) tile(std::integral_constant<int, T>{}, r);
    // the rest as one tile: k + 1 <= T verification rows decode each group once
    simd::with_count(r1 - r, [&](auto mt) { tile(mt, r); });
}

// tile(MT, r) for rows [r0, r1) in the fewest tiles of at most T, their sizes within one of each other
// (17 rows, T = 8: 6, 6, 5, not 8, 8, 1), for tiles that pay per tile what a row-by-row tile pays per row.
template <int T = 8, class Tile>
inline void balanced_tiles(int64_t r0, int64_t r1, Tile tile) {
    const int64_t n = r1 - r0, tiles = (n + T - 1) / T;
    for (int64_t i = 0, r = r0; i < tiles; ++i) {
        const int64_t mt = (n - (r - r0)) / (tiles - i);  // the rest spread over the tiles left
        simd::with_count<T>(mt, [&](auto m) { tile(m, r); });
        r += mt;
    }
}

// Runs feature(j, r0, r1) over every output feature j in [0, n) (in parallel), for rows in blocks of
// `row_block` of float32 x (each output's arithmetic never depends on the blocking: row_tiles).
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

// y[r] = the fixed horizontal sum of acc[r] + the offsets' term.
template <int MT>
inline void finish(const __m256* acc, int64_t groups, const float* xsum, const float* offset, float* y, int64_t ldy) {
    for (int r = 0; r < MT; ++r)
        y[r * ldy] = hsum(acc[r]) + (offset ? offset_dot(offset, xsum + r * groups, groups) : 0.f);
}

// Each line of [p, p + bytes) into the L1 cache.
inline void prefetch_lines(const void* p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) simd::prefetch<_MM_HINT_T0>((const char*)p + b);
}

// Part `part` of `parts` of [p, p + bytes) into L1 (hint T0) or L2 (T1).
template <_mm_hint HINT>
inline void prefetch_part(const void* p, int64_t bytes, int part, int parts) {
    const int64_t lines = (bytes + 63) / 64, l0 = lines * part / parts, l1 = lines * (part + 1) / parts;
    for (int64_t l = l0; l < l1; ++l) simd::prefetch<HINT>((const char*)p + 64 * l);
}

// Group g's eighth of the super-block after t's (a tile's `bytes` each) into L1 and of the one three
// ahead into L2: a super-block's requests spread over its eight groups, not one burst at its start
// that the miss queues must hold.
inline void prefetch_group(const uint8_t* t, int64_t bytes, int g) {
    prefetch_part<_MM_HINT_T0>(t + bytes, bytes, g, 8);
    prefetch_part<_MM_HINT_T1>(t + 3 * bytes, bytes, g, 8);
}

// Each line of [p, p + bytes) into the L2 cache: a stream's lines asked for further ahead than L1's
// fill buffers could hold (cpu-kernels.md).
inline void prefetch_l2(const void* p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) simd::prefetch<_MM_HINT_T1>((const char*)p + b);
}

}  // namespace
