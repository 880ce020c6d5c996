// Paged attention, built twice: AVX2 (attention.cpp) and AVX-512 (attention_avx512.cpp, where the CPU has
// it). Each query row attends over exactly its own context, read through the cache slots in place from
// any of the K/V cache's row formats (kv_format.py). In PyTorch this gathered every context token's K/V per
// layer and ran one SDPA call per query row.
//
// Batch invariance by construction: each row's result is computed by one thread in a fixed order,
// whatever the number of rows or what else shares the forward. The two builds do the same float
// operations on every output element, in the same order (a wider vector only holds more independent
// elements): their results are bitwise the same.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using simd::exp8;
using simd::hmax8;
using simd::hsum;

// Lane j of the result: a[j]'s eight lanes summed as ((0+1)+(2+3))+((4+5)+(6+7)), whatever the other
// seven vectors hold, so a dot product's bits do not depend on what it is reduced with.
inline __m256 hsum8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The tile's products, scaled, out to s[h][0 .. NK).
template <int NH, int NK>
inline void store_scores(const __m256* acc, float scale, float* const* s) {
    const __m256 dots = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
    if constexpr (NH == 2 && NK == 4) {  // the full tile: each head's four scores are one half
        _mm_storeu_ps(s[0], _mm256_castps256_ps128(dots));
        _mm_storeu_ps(s[1], _mm256_extractf128_ps(dots, 1));
    } else {
        float out[8];
        _mm256_storeu_ps(out, dots);
        for (int h = 0; h < NH; ++h)
            for (int j = 0; j < NK; ++j) s[h][j] = out[h * NK + j];
    }
}

// s[h][j] = scale * q_h . k_j over d (a multiple of 8) for NH query heads and NK keys, NH * NK <= 8:
// one accumulator per product (eight independent chains at full size), each query and key chunk loaded
// once for the tile. Every product's arithmetic is the same whatever tile it is in.
template <int NH, int NK>
inline void qk_tile(const float* const* q, const float* const* k, int64_t d, float scale, float* const* s) {
    static_assert(NH * NK <= 8);
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        for (int h = 0; h < NH; ++h) {
            const __m256 qc = _mm256_loadu_ps(q[h] + i);
            for (int j = 0; j < NK; ++j)
                acc[h * NK + j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[j] + i), acc[h * NK + j]);
        }
    store_scores<NH, NK>(acc, scale, s);
}

// The full tile, two heads by four keys, as qk_tile<2, 4> computes it, each key chunk loaded once into
// a register for both heads.
template <>
inline void qk_tile<2, 4>(const float* const* q, const float* const* k, int64_t d, float scale, float* const* s) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
    for (int64_t i = 0; i < d; i += 8) {
        __m256 a = _mm256_loadu_ps(k0 + i), b = _mm256_loadu_ps(k1 + i), c = _mm256_loadu_ps(k2 + i),
               e = _mm256_loadu_ps(k3 + i);
        __asm__("" : "+x"(a), "+x"(b), "+x"(c), "+x"(e));  // loaded once: else each FMA reloads its key
        for (int h = 0; h < 2; ++h) {
            const __m256 qc = _mm256_loadu_ps(q[h] + i);
            acc[4 * h] = _mm256_fmadd_ps(qc, a, acc[4 * h]);
            acc[4 * h + 1] = _mm256_fmadd_ps(qc, b, acc[4 * h + 1]);
            acc[4 * h + 2] = _mm256_fmadd_ps(qc, c, acc[4 * h + 2]);
            acc[4 * h + 3] = _mm256_fmadd_ps(qc, e, acc[4 * h + 3]);
        }
    }
    store_scores<2, 4>(acc, scale, s);
}

#ifdef __AVX512F__
// Head pairs' queries side by side, [pairs][d / 8][16]: pair p's chunk i is q_2p[8i, 8i + 8) then q_2p+1's.
inline void pair_queries(const float* qh, int64_t pairs, int64_t d, float* out) {
    for (int64_t p = 0; p < pairs; ++p)
        for (int64_t i = 0; i < d; i += 8) {
            memcpy(out + 2 * (p * d + i), qh + 2 * p * d + i, 32);
            memcpy(out + 2 * (p * d + i) + 8, qh + (2 * p + 1) * d + i, 32);
        }
}

// qk_tile<2, 4> for NP head pairs at once (qp: pair_queries) and keys t .. t + 3, a pair's two products
// with one key in the two halves of a 16-float vector: each product's multiply-adds and sum are
// qk_tile<2, 4>'s, and each key chunk is loaded once for all 2 * NP heads. s[2p], s[2p + 1]: pair p's
// heads' four scores.
template <int NP, class Rows>
inline void qk_pairs16(const float* qp, const Rows& keys, int64_t t, int64_t d, float scale, float* const* s) {
    __m512 acc[NP][4];
    for (int p = 0; p < NP; ++p)
        for (int j = 0; j < 4; ++j) acc[p][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m512 kc[4];
        for (int j = 0; j < 4; ++j) kc[j] = both8(keys, t + j, i);  // keys t .. t + 3, the chunk in both halves
        for (int p = 0; p < NP; ++p) {
            const __m512 qc = _mm512_loadu_ps(qp + 2 * (p * d + i));
            for (int j = 0; j < 4; ++j) acc[p][j] = _mm512_fmadd_ps(qc, kc[j], acc[p][j]);
        }
    }
    for (int p = 0; p < NP; ++p) {
        __m256 a[8];  // qk_tile<2, 4>'s accumulators: head 2p's four keys, then head 2p + 1's
        for (int j = 0; j < 4; ++j) {
            a[j] = _mm512_castps512_ps256(acc[p][j]);
            a[4 + j] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][j]), 1));
        }
        store_scores<2, 4>(a, scale, s + 2 * p);
    }
}
#endif

// acc_h[0 .. 8W) += sum over t in [t0, t1), in order, of p_h[t] * v_t[0 .. 8W) for NH query heads h,
// v_t = v.row(t) + i0 (KvRows): the accumulators stay in registers over the block, and each chunk of a
// value row is loaded once for the NH heads. ahead: ask for the same values kAhead rows on (KvSource).
template <int NH, int W, class Rows>
inline void pv_tile(const float* const* p, const Rows& v, int64_t i0, int64_t t0, int64_t t1, float* const* acc,
                    bool ahead) {
    __m256 r[NH][W];
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) r[h][w] = _mm256_loadu_ps(acc[h] + i0 + 8 * w);
    for (int64_t t = t0; t < t1; ++t) {
        const float* vt = v.row(t) + i0;
        if (ahead) v.ahead(t, i0 * sizeof(*v.cache));
        __m256 vc[W];
        for (int w = 0; w < W; ++w) vc[w] = _mm256_loadu_ps(vt + 8 * w);
        for (int h = 0; h < NH; ++h) {
            const __m256 pt = _mm256_broadcast_ss(p[h] + t);
            for (int w = 0; w < W; ++w) r[h][w] = _mm256_fmadd_ps(pt, vc[w], r[h][w]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc[h] + i0 + 8 * w, r[h][w]);
}

#ifdef __AVX512F__
// pv_tile in 16-float vectors: each output element's multiply-adds are pv_tile's, in the same order.
// Up to six heads by four vectors (64 values of a row) stay in the 32 registers.
template <int NH, int W, class Rows>
inline void pv_tile16(const float* const* p, const Rows& v, int64_t i0, int64_t t0, int64_t t1, float* const* acc,
                      bool ahead) {
    __m512 r[NH][W];
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) r[h][w] = _mm512_loadu_ps(acc[h] + i0 + 16 * w);
    const int64_t bytes = sizeof(*v.cache);
    for (int64_t t = t0; t < t1; ++t) {
        if (ahead)
            for (int64_t b = i0 * bytes; b < (i0 + 16 * W) * bytes; b += 64) v.ahead(t, b);
        __m512 vc[W];
        for (int w = 0; w < W; ++w) vc[w] = load16(v, t, i0 + 16 * w);
        for (int h = 0; h < NH; ++h) {
            const __m512 pt = _mm512_set1_ps(p[h][t]);
            for (int w = 0; w < W; ++w) r[h][w] = _mm512_fmadd_ps(pt, vc[w], r[h][w]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int w = 0; w < W; ++w) _mm512_storeu_ps(acc[h] + i0 + 16 * w, r[h][w]);
}
#endif

// Softmax in place over s[0, len): the maximum subtracted, the exponentials summed in a fixed order,
// then each divided by the sum.
inline void softmax_(float* s, int64_t len) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float m = hmax8(mv);
    for (int64_t u = t; u < len; ++u) m = s[u] > m ? s[u] : m;
    const __m256 m8 = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
        _mm256_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum(sum8);
    if (t < len) {  // the last 1-7 scores, padded
        float tail[8];
        for (int u = 0; u < 8; ++u) tail[u] = t + u < len ? s[t + u] - m : -INFINITY;
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        for (int64_t u = t; u < len; ++u) { s[u] = tail[u - t]; sum += s[u]; }
    }
    const __m256 inv = _mm256_set1_ps(sum);
    for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(s + t, _mm256_div_ps(_mm256_loadu_ps(s + t), inv));
    for (; t < len; ++t) s[t] /= sum;
}

constexpr int64_t kTokenBlock = 32;  // 32 keys or values of d = 128: 16 KB
constexpr int64_t kMaxRun = 16;      // rows sharing one pass (their scores and outputs stay in cache)
constexpr int64_t kAhead = kTokenBlock;  // how far ahead of their use K/V rows are asked for (a block: 16 KB)

// Where each run of rows sharing a pass starts: row r + 1 joins row r's run when its context is row r's
// followed by more slots.
std::vector<int64_t> shared_runs(int64_t rows, const int64_t* ctx_slots, const int64_t* ctx_start,
                                 const int64_t* ctx_len) {
    std::vector<int64_t> starts;
    for (int64_t r = 0; r < rows; ++r) {
        const bool extends = r > 0 && r - starts.back() < kMaxRun && ctx_len[r] >= ctx_len[r - 1] &&
                             std::equal(ctx_slots + ctx_start[r - 1], ctx_slots + ctx_start[r - 1] + ctx_len[r - 1],
                                        ctx_slots + ctx_start[r]);
        if (!extends) starts.push_back(r);
    }
    starts.push_back(rows);
    return starts;
}

// One KV head's keys (or values) at context positions t < end, rows of `stride` elements, read as float32
// rows of d: in place from a float32 cache; from a float16 or int8 cache each block is widened once
// (exactly, or as code * scale) into a buffer that every row and query head of the run then reads, so the
// conversion is not repeated per query head.
// plan(t0) looks up where the rows kAhead positions past the block at t0 lie; ahead(t, byte) then asks
// for the line at `byte` of row t + kAhead while row t is worked on, so the reads are spread over the
// arithmetic instead of waiting at each block's start.
template <class T>
struct KvSource {
    const T* cache;
    const int64_t* slots;
    int64_t d, stride, end;
    const char* next[kTokenBlock] = {};
    int64_t planned = -1;
    const T* source(int64_t t) const { return cache + slots[t] * stride; }
    void plan(int64_t t0) {
        if (t0 == planned) return;
        planned = t0;
        for (int64_t j = 0; j < kTokenBlock; ++j)
            next[j] = t0 + kAhead + j < end ? (const char*)source(t0 + kAhead + j) : nullptr;
    }
    void ahead(int64_t t, int64_t byte) const {
        if (const char* p = next[t - planned]) _mm_prefetch(p + byte, _MM_HINT_T0);
    }
};

// A row of the 16- or 8-bit formats widened to float32 (kv_format.py's reading).
inline void widen(const uint16_t* src, int64_t d, float* dst) {
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
}

inline void widen(const int8_t* src, int64_t d, float* dst) {
    const int64_t group = kv_group(d);
    for (int64_t g = 0; g < d / group; ++g) {
        float scale;
        memcpy(&scale, src + d + 4 * g, 4);
        const __m256 s = _mm256_set1_ps(scale);
        for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
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
// 16 values of row t from element i as floats: a float16 cache's widened in the register, others read
// as row() gives them; the same floats either way.
inline __m512 load16(const KvRows<uint16_t>& v, int64_t t, int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(v.source(t) + i)));
}
template <class Rows>
inline __m512 load16(const Rows& v, int64_t t, int64_t i) {
    return _mm512_loadu_ps(v.row(t) + i);
}

// 8 values of row t from element i, as load16 reads them, in both halves of a 16-float vector.
inline __m512 both8(const KvRows<uint16_t>& v, int64_t t, int64_t i) {
    const __m256d c = _mm256_castps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v.source(t) + i))));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(c), c, 1));
}
template <class Rows>
inline __m512 both8(const Rows& v, int64_t t, int64_t i) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(v.row(t) + i))));
}
#endif

// f(r, t0, t1) for each block of kTokenBlock positions [t0, t1) of each row r in [r0, r1) that reaches
// it, blocks outermost: a block is read from memory for the first row and from the L1 cache for the rest.
template <class F>
void blocks_of_run(int64_t r0, int64_t r1, const int64_t* ctx_len, F f) {
    for (int64_t t0 = 0; t0 < ctx_len[r1 - 1]; t0 += kTokenBlock)
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t len = ctx_len[r], t1 = t0 + kTokenBlock < len ? t0 + kTokenBlock : len;
            if (t0 < t1) f(r, t0, t1);
        }
}

// Scores of rows [r0, r1) (each against its own context) for one KV head's query heads.
// scores[i]: [group, ctx_len[r0 + i]].
template <class T>
void run_scores(const float* q, int64_t ldq, int64_t r0, int64_t r1, int64_t group, int64_t kvh, int64_t d,
                const T* k_cache, int64_t stride, const int64_t* slots, const int64_t* ctx_len,
                float scale, std::vector<std::vector<float>>& scores) {
    KvRows<T> keys{{k_cache, slots, d, stride, ctx_len[r1 - 1]}};
    const int64_t pairs = group / 2;
#ifdef __AVX512F__
    std::vector<float> qp(pairs <= 4 ? (r1 - r0) * pairs * 2 * d : 0);
    if (!qp.empty())
        for (int64_t r = r0; r < r1; ++r)
            pair_queries(q + r * ldq + kvh * group * d, pairs, d, qp.data() + (r - r0) * pairs * 2 * d);
#endif
    blocks_of_run(r0, r1, ctx_len, [&](int64_t r, int64_t t0, int64_t t1) {
        const int64_t len = ctx_len[r];
        keys.begin(t0, std::min(t0 + kTokenBlock, keys.end));
        keys.plan(t0);
        const float* qh = q + r * ldq + kvh * group * d;
        float* sc = scores[r - r0].data();
        int64_t paired = t0;  // the keys before it are scored for every head pair
#ifdef __AVX512F__
        for (; !qp.empty() && paired + 4 <= t1; paired += 4) {  // every pair at once, four keys at a time
            float* out[8];
            if (r == r0)
                for (int j = 0; j < 4; ++j)
                    for (int64_t b = 0; b < stride * (int64_t)sizeof(T); b += 64) keys.ahead(paired + j, b);
            for (int64_t h = 0; h < 2 * pairs; ++h) out[h] = sc + h * len + paired;
            simd::with_count<4>(pairs, [&](auto n) {
                qk_pairs16<decltype(n)::value>(qp.data() + (r - r0) * pairs * 2 * d, keys, paired, d, scale, out);
            });
        }
#endif
        for (int64_t g = 0; g < group; g += 2) {  // query heads in pairs (a last one alone), four keys at once
            const int64_t nh = std::min<int64_t>(2, group - g);
            const float* qs[2] = {qh + g * d, qh + (g + nh - 1) * d};
            int64_t t = nh == 2 ? paired : t0;
            while (t < t1) {
                const int64_t nk = std::min<int64_t>(8 / nh, t1 - t);
                const float* ks[8];
                float* out[2] = {sc + g * len + t, sc + (g + nh - 1) * len + t};
                for (int j = 0; j < nk; ++j) ks[j] = keys.row(t + j);
                if (r == r0 && g == 0)  // the first row's first pass brings the rows in
                    for (int j = 0; j < nk; ++j)
                        for (int64_t b = 0; b < stride * (int64_t)sizeof(T); b += 64) keys.ahead(t + j, b);
                simd::with_count<8>(nk, [&](auto n) {
                    constexpr int NK = decltype(n)::value;
                    if (nh == 2) {
                        if constexpr (NK <= 4) qk_tile<2, NK>(qs, ks, d, scale, out);
                    } else {
                        qk_tile<1, NK>(qs, ks, d, scale, out);
                    }
                });
                t += nk;
            }
        }
    });
}

// acc[i] ([group, d]) = the probabilities of rows [r0, r1) times the values; each output sums over t in
// order, as one pass would, in registers over a block.
template <class T>
void run_values(int64_t r0, int64_t r1, int64_t group, int64_t d, const T* v_cache, int64_t stride,
                const int64_t* slots, const int64_t* ctx_len, const std::vector<std::vector<float>>& scores,
                std::vector<std::vector<float>>& acc) {
    KvRows<T> values{{v_cache, slots, d, stride, ctx_len[r1 - 1]}};
    blocks_of_run(r0, r1, ctx_len, [&](int64_t r, int64_t t0, int64_t t1) {
        values.begin(t0, std::min(t0 + kTokenBlock, values.end));
        values.plan(t0);
        for (int64_t g = 0; g < group; g += 6) {  // up to six query heads share each value chunk
            const int64_t nh = std::min<int64_t>(6, group - g);
            const float* ps[6];
            float* accs[6];
            for (int64_t h = 0; h < nh; ++h) {
                ps[h] = scores[r - r0].data() + (g + h) * ctx_len[r];
                accs[h] = acc[r - r0].data() + (g + h) * d;
            }
            const bool first = r == r0 && g == 0;  // the first row's first pass brings the rows in
            simd::with_count<6>(nh, [&](auto n) {
                constexpr int NH = decltype(n)::value;
                int64_t i0 = 0;
#ifdef __AVX512F__
                for (; i0 + 64 <= d; i0 += 64) pv_tile16<NH, 4>(ps, values, i0, t0, t1, accs, first);
                for (; i0 + 16 <= d; i0 += 16) pv_tile16<NH, 1>(ps, values, i0, t0, t1, accs, first);
#endif
                for (; i0 + 16 <= d; i0 += 16) pv_tile<NH, 2>(ps, values, i0, t0, t1, accs, first);
                if (i0 < d) pv_tile<NH, 1>(ps, values, i0, t0, t1, accs, first);
            });
        }
    });
}

template <class T>
void attend(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
            int64_t kv_slots, const T* k_cache, const T* v_cache, const int64_t* ctx_slots,
            const int64_t* ctx_start, const int64_t* ctx_len, float scale, float* out, int threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t stride = std::is_same<T, int8_t>::value ? kv_int8_row(d) : d;  // an int8 row ends with its scales
    const std::vector<int64_t> runs = shared_runs(rows, ctx_slots, ctx_start, ctx_len);
    const int64_t num_runs = (int64_t)runs.size() - 1;
#pragma omp parallel num_threads(threads)
    {
        std::vector<std::vector<float>> scores(kMaxRun), acc(kMaxRun);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_runs * num_kv_heads; ++task) {
            const int64_t run = task / num_kv_heads, kvh = task % num_kv_heads;
            const int64_t r0 = runs[run], r1 = runs[run + 1];
            const int64_t* slots = ctx_slots + ctx_start[r1 - 1];  // the longest context holds the others
            for (int64_t r = r0; r < r1; ++r) {
                scores[r - r0].resize(group * ctx_len[r]);
                acc[r - r0].assign(group * d, 0.f);
            }
            const T *keys = k_cache + kvh * kv_slots * stride, *values = v_cache + kvh * kv_slots * stride;
            run_scores(q, ldq, r0, r1, group, kvh, d, keys, stride, slots, ctx_len, scale, scores);
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t g = 0; g < group; ++g) softmax_(scores[r - r0].data() + g * ctx_len[r], ctx_len[r]);
            run_values(r0, r1, group, d, values, stride, slots, ctx_len, scores, acc);
            for (int64_t r = r0; r < r1; ++r) {
                float* o = out + r * num_heads * d + kvh * group * d;
                for (int64_t i = 0; i < group * d; ++i) o[i] = acc[r - r0][i];
            }
        }
    }
}

// attend() for the cache's row format.
inline void attend_format(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                          int64_t d, int64_t kv_slots, const void* k_cache, const void* v_cache,
                          const int64_t* ctx_slots, const int64_t* ctx_start, const int64_t* ctx_len, float scale,
                          float* out, int threads, int kv_format) {
    auto run = [&](auto type) {
        using T = decltype(type);
        attend(q, ldq, rows, num_heads, num_kv_heads, d, kv_slots, (const T*)k_cache, (const T*)v_cache, ctx_slots,
               ctx_start, ctx_len, scale, out, threads);
    };
    if (kv_format == KV_FORMAT_F16) run(uint16_t{});
    else if (kv_format == KV_FORMAT_I8) run(int8_t{});
    else run(float{});
}

}  // namespace

// The attention of kernels.h, built with AVX-512 (attention_avx512.cpp); attention.cpp calls it where the
// CPU has it and the integer paths are not pinned to AVX2 (kernel_isa).
void attention_avx512(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                      int64_t kv_slots, const void* k_cache, const void* v_cache, const int64_t* ctx_slots,
                      const int64_t* ctx_start, const int64_t* ctx_len, float scale, float* out, int threads,
                      int kv_format);
