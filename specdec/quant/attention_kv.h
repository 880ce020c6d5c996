// The K/V cache as attention reads it (attention.h): a KV head's rows at context positions through the
// cache slots, in any of the row formats (kv_format.py), the next block's lines asked for ahead.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kTokenBlock = 32;  // 32 keys or values of d = 128: 16 KB
constexpr int64_t kAhead = kTokenBlock;  // how far ahead of their use K/V rows are asked for (a block: 16 KB)
constexpr int64_t kFar = 8 * kTokenBlock;  // and into L2 this far ahead (64 KB of float16 rows)
template <class T>  // int8 rows, half as many bytes, are bound by their arithmetic: the L2 requests only cost
constexpr bool kAskFar = !std::is_same<T, int8_t>::value;

// One KV head's keys (or values) at context positions t < end, rows of `stride` elements, read as float32
// rows of d: in place from a float32 cache; from a float16 or int8 cache each block is widened once
// (exactly, or as code * scale) into a buffer that every row and query head of the run then reads, so the
// conversion is not repeated per query head.
// plan(t0) looks up where the rows kAhead and kFar positions past the block at t0 lie; ahead(t, byte) then
// asks for the line at `byte` of row t + kAhead into L1 and of row t + kFar into L2 while row t is worked
// on, so the reads are spread over the arithmetic instead of waiting at each block's start, and more of
// them are in flight than L1's miss buffers hold.
template <class T>
struct KvSource {
    const T* cache;
    const int64_t* slots;
    int64_t d, stride, end;
    const char* next[kTokenBlock] = {};
    const char* far[kTokenBlock] = {};
    int64_t planned = -1;
    const T* source(int64_t t) const { return cache + slots[t] * stride; }
    void plan(int64_t t0) {
        if (t0 == planned) return;
        planned = t0;
        for (int64_t j = 0; j < kTokenBlock; ++j)
            next[j] = t0 + kAhead + j < end ? (const char*)source(t0 + kAhead + j) : nullptr;
        if constexpr (kAskFar<T>)
            for (int64_t j = 0; j < kTokenBlock; ++j)
                far[j] = t0 + kFar + j < end ? (const char*)source(t0 + kFar + j) : nullptr;
    }
    void ahead(int64_t t, int64_t byte) const {
        if (const char* p = next[t - planned]) simd::prefetch<_MM_HINT_T0>(p + byte);
        if constexpr (kAskFar<T>)
            if (const char* p = far[t - planned]) simd::prefetch<_MM_HINT_T1>(p + byte);
    }
};

// A row of the 16- or 8-bit formats widened to float32 (kv_format.py's reading).
inline void widen(const uint16_t* src, int64_t d, float* dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
#endif
    for (; i < d; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
}

inline void widen(const int8_t* src, int64_t d, float* dst) {
    const int64_t group = kv_group(d);
    for (int64_t g = 0; g < d / group; ++g) {
        float scale;
        memcpy(&scale, src + d + 4 * g, 4);
        int64_t i = g * group;
#ifdef __AVX512F__
        for (; i + 16 <= (g + 1) * group; i += 16) {
            const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + i)));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(codes), _mm512_set1_ps(scale)));
        }
#endif
        const __m256 s = _mm256_set1_ps(scale);
        for (; i < (g + 1) * group; i += 8) {
            const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(src + i)));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(codes), s));
        }
    }
}

template <class T>
struct KvRows : KvSource<T> {
    mutable std::vector<float> buf = {};
    int64_t first = -1, last = -1;
    mutable bool widened = false;
    void begin(int64_t t0, int64_t t1) {  // the block [t0, t1), unless it is the one held
        if (t0 == first) return;
        first = t0, last = t1, widened = false;
    }
    const float* row(int64_t t) const {  // the block widened on first use (the AVX-512 tiles read float16 as it is)
        if (!widened) {
            buf.resize(kTokenBlock * this->d);
            for (int64_t u = first; u < last; ++u) widen(this->source(u), this->d, buf.data() + (u - first) * this->d);
            widened = true;
        }
        return buf.data() + (t - first) * this->d;
    }
};

template <>
struct KvRows<float> : KvSource<float> {  // read in place
    void begin(int64_t, int64_t) {}
    const float* row(int64_t t) const { return source(t); }
};

#ifdef __AVX512F__
// Row t as the AVX-512 tiles read it: a float16 cache's in place (widened in the register), others as
// row() gives them. Looked up once per row, then read chunk by chunk below.
inline const uint16_t* row_at(const KvRows<uint16_t>& v, int64_t t) { return v.source(t); }
template <class Rows>
inline const float* row_at(const Rows& v, int64_t t) {
    return v.row(t);
}

// 16 values from p as floats: the same floats from either kind of row.
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 8 values from p, as load16 reads them, in both halves of a 16-float vector.
inline __m512 both8(const uint16_t* p) {
    const __m256d c = _mm256_castps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(c), c, 1));
}
inline __m512 both8(const float* p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}
#endif

}  // namespace
