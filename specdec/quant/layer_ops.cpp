// The decoder's float32 glue for AVX2 CPUs: RMSNorm (with the residual add), rotary embeddings and
// paged attention. In PyTorch each is a handful of small ops, and at one token per forward their
// dispatch costs more than their arithmetic (a quarter of a 1.5B int4 decode step); attention also
// gathered every context token's K/V per layer and ran one SDPA call per query row.
//
// Batch invariance by construction, as in qlinear.cpp: each row's result is computed by one thread
// in a fixed order, whatever the number of rows or what else shares the forward.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using simd::hsum;

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// exp: Cephes' range reduction and polynomial, about 1 ulp; below -87 the result is 0, above 88 it
// saturates at exp(88).
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float dot(const float* a, const float* b, int64_t n) {  // n a multiple of 8
    __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)), s1 = _mm256_setzero_ps();
    int64_t i = 8;
    for (; i + 16 <= n; i += 16) {
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s1);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s0);
    }
    if (i < n) s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s1);
    return hsum(_mm256_add_ps(s0, s1));
}

// dot(a, b_j, n) for four vectors b_j at once, each with exactly dot()'s arithmetic (so the same bits):
// a's chunks are loaded once for the four.
inline void dot4(const float* a, const float* const* b, int64_t n, float* out) {
    __m256 s0[4], s1[4];
    const __m256 a0 = _mm256_loadu_ps(a);
    for (int j = 0; j < 4; ++j) s0[j] = _mm256_mul_ps(a0, _mm256_loadu_ps(b[j])), s1[j] = _mm256_setzero_ps();
    int64_t i = 8;
    for (; i + 16 <= n; i += 16) {
        const __m256 x1 = _mm256_loadu_ps(a + i), x2 = _mm256_loadu_ps(a + i + 8);
        for (int j = 0; j < 4; ++j) {
            s1[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(b[j] + i), s1[j]);
            s0[j] = _mm256_fmadd_ps(x2, _mm256_loadu_ps(b[j] + i + 8), s0[j]);
        }
    }
    if (i < n) {
        const __m256 x1 = _mm256_loadu_ps(a + i);
        for (int j = 0; j < 4; ++j) s1[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(b[j] + i), s1[j]);
    }
    for (int j = 0; j < 4; ++j) out[j] = hsum(_mm256_add_ps(s0[j], s1[j]));
}

// acc[0 .. 8W) += sum over t in [t0, t1), in order, of p[t] * v_t[0 .. 8W), v_t = v.row(t) + i0 (KvRows);
// the accumulators stay in registers over the block.
template <int W, class Rows>
inline void pv_block(const float* p, const Rows& v, int64_t i0, int64_t t0, int64_t t1, float* acc) {
    __m256 r[W];
    for (int i = 0; i < W; ++i) r[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t t = t0; t < t1; ++t) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const float* vt = v.row(t) + i0;
        for (int i = 0; i < W; ++i) r[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * i), r[i]);
    }
    for (int i = 0; i < W; ++i) _mm256_storeu_ps(acc + 8 * i, r[i]);
}

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

// One KV head's keys (or values) at context positions t, read as float32 rows of d: in place from a
// float32 cache; from a float16 cache each block is widened once (exactly) into a buffer that every row
// and query head of the run then reads, so the conversion is not repeated per query head.
template <class T>
struct KvRows;

template <>
struct KvRows<float> {
    const float* cache;
    const int64_t* slots;
    int64_t stride, offset, d;
    void begin(int64_t, int64_t) {}
    const float* row(int64_t t) const { return cache + slots[t] * stride + offset; }
};

template <>
struct KvRows<uint16_t> {
    const uint16_t* cache;
    const int64_t* slots;
    int64_t stride, offset, d;
    std::vector<float> buf = {};
    int64_t first = -1;
    void begin(int64_t t0, int64_t t1) {  // the block [t0, t1), unless it is the one held
        if (t0 == first) return;
        first = t0;
        buf.resize(kTokenBlock * d);
        for (int64_t t = t0; t < t1; ++t) {
            const uint16_t* src = cache + slots[t] * stride + offset;
            float* dst = buf.data() + (t - t0) * d;
            for (int64_t i = 0; i < d; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
        }
    }
    const float* row(int64_t t) const { return buf.data() + (t - first) * d; }
};

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
void run_scores(const float* q, int64_t ldq, int64_t r0, int64_t r1, int64_t group, int64_t num_kv_heads,
                int64_t kvh, int64_t d, const T* k_cache, const int64_t* slots, const int64_t* ctx_len,
                float scale, std::vector<std::vector<float>>& scores) {
    KvRows<T> keys{k_cache, slots, num_kv_heads * d, kvh * d, d};
    blocks_of_run(r0, r1, ctx_len, [&](int64_t r, int64_t t0, int64_t t1) {
        const int64_t len = ctx_len[r];
        keys.begin(t0, std::min(t0 + kTokenBlock, ctx_len[r1 - 1]));
        const float* qh = q + r * ldq + kvh * group * d;
        float* sc = scores[r - r0].data();
        for (int64_t g = 0; g < group; ++g) {
            int64_t t = t0;
            for (; t + 4 <= t1; t += 4) {
                const float* kp[4];
                float dots[4];
                for (int j = 0; j < 4; ++j) kp[j] = keys.row(t + j);
                dot4(qh + g * d, kp, d, dots);
                for (int j = 0; j < 4; ++j) sc[g * len + t + j] = dots[j] * scale;
            }
            for (; t < t1; ++t)
                sc[g * len + t] = dot(qh + g * d, keys.row(t), d) * scale;
        }
    });
}

// acc[i] ([group, d]) = the probabilities of rows [r0, r1) times the values; each output sums over t in
// order, as one pass would, 64 of its values in registers over a block.
template <class T>
void run_values(int64_t r0, int64_t r1, int64_t group, int64_t num_kv_heads, int64_t kvh, int64_t d,
                const T* v_cache, const int64_t* slots, const int64_t* ctx_len,
                const std::vector<std::vector<float>>& scores, std::vector<std::vector<float>>& acc) {
    KvRows<T> values{v_cache, slots, num_kv_heads * d, kvh * d, d};
    blocks_of_run(r0, r1, ctx_len, [&](int64_t r, int64_t t0, int64_t t1) {
        values.begin(t0, std::min(t0 + kTokenBlock, ctx_len[r1 - 1]));
        for (int64_t g = 0; g < group; ++g) {
            const float* p = scores[r - r0].data() + g * ctx_len[r];
            float* a = acc[r - r0].data() + g * d;
            int64_t i0 = 0;
            for (; i0 + 64 <= d; i0 += 64) pv_block<8>(p, values, i0, t0, t1, a + i0);
            simd::with_count((d - i0) / 8, [&](auto w) {  // the last 8-56 values
                pv_block<decltype(w)::value>(p, values, i0, t0, t1, a + i0);
            });
        }
    });
}

template <class T>
void attend(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
            const T* k_cache, const T* v_cache, const int64_t* ctx_slots, const int64_t* ctx_start,
            const int64_t* ctx_len, float scale, float* out, int threads) {
    const int64_t group = num_heads / num_kv_heads;
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
            run_scores(q, ldq, r0, r1, group, num_kv_heads, kvh, d, k_cache, slots, ctx_len, scale, scores);
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t g = 0; g < group; ++g) softmax_(scores[r - r0].data() + g * ctx_len[r], ctx_len[r]);
            run_values(r0, r1, group, num_kv_heads, kvh, d, v_cache, slots, ctx_len, scores, acc);
            for (int64_t r = r0; r < r1; ++r) {
                float* o = out + r * num_heads * d + kvh * group * d;
                for (int64_t i = 0; i < group * d; ++i) o[i] = acc[r - r0][i];
            }
        }
    }
}

}  // namespace

extern "C" {

// x: [rows, h] (row stride ldx), w: [h], out: [rows, h] contiguous; h a multiple of 8.
// delta != null: x += delta first (the residual add, in place; delta row stride ldd).
// out = w * (x * (1 / sqrt(mean(x^2) + eps))), the reference implementations' order of operations.
void rms_norm(float* x, int64_t ldx, const float* delta, int64_t ldd, int64_t rows, int64_t h, const float* w,
              float eps, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * ldx;
        if (delta)
            for (int64_t i = 0; i < h; i += 8)
                _mm256_storeu_ps(xr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(delta + r * ldd + i)));
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < h; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / (float)h + eps));
        for (int64_t i = 0; i < h; i += 8)
            _mm256_storeu_ps(out + r * h + i,
                             _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), inv)));
    }
}

// Rotate-half ("NeoX") rotary embedding in place on `heads` heads of each row: x: [rows, heads, d]
// with row stride ldx; cos, sin: [max_positions, d]; positions: [rows]. d a multiple of 16.
// out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2 (separate multiplies, no FMA: the same
// rounding as the PyTorch formula).
void rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t d, const int64_t* positions,
          const float* cos, const float* sin) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; ++r) {
        const float* c = cos + positions[r] * d;
        const float* s = sin + positions[r] * d;
        for (int64_t hd = 0; hd < heads; ++hd) {
            float* p = x + r * ldx + hd * d;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 x1 = _mm256_loadu_ps(p + i), x2 = _mm256_loadu_ps(p + half + i);
                __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(x2, _mm256_loadu_ps(s + i)));
                __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(p + i, o1);
                _mm256_storeu_ps(p + half + i, o2);
            }
        }
    }
}

// SwiGLU's activation: out[r, i] = silu(gate[r, i]) * up[r, i], silu(g) = g / (1 + exp(-g)), with
// gate|up side by side in each row of x: [rows, 2 * n]; out: [rows, n]. n a multiple of 8.
void silu_mul(const float* x, int64_t rows, int64_t n, float* out, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; i += 8) {
            __m256 g = _mm256_loadu_ps(x + r * 2 * n + i), u = _mm256_loadu_ps(x + r * 2 * n + n + i);
            __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(out + r * n + i, _mm256_mul_ps(silu, u));
        }
}

// Causal attention of each query row over exactly its own context, read through the cache slots.
// q: [rows, num_heads, d] (row stride ldq); k_cache, v_cache: [slots, num_kv_heads, d];
// ctx_slots: the slots of every row's context, row r's at ctx_slots[ctx_start[r] .. + ctx_len[r]];
// out: [rows, num_heads * d] contiguous. The num_heads / num_kv_heads query heads sharing a KV head
// are done together, and so are consecutive rows whose contexts extend one another (a verification's
// k + 1 rows): each block of 32 keys or values is read from memory once for all of them, then from the
// L1 cache; a query is read once for four keys. scores = q.k * scale; softmax with the maximum
// subtracted; out = sum_t p_t v_t, with p normalized first. Each output's operations are the same
// whatever it is grouped with. d a multiple of 8. kv_f16: the caches hold float16 (IEEE half), widened to
// float32 as they are read; else float32.
void attention(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
               const void* k_cache, const void* v_cache, const int64_t* ctx_slots, const int64_t* ctx_start,
               const int64_t* ctx_len, float scale, float* out, int threads, int kv_f16) {
    if (kv_f16)
        attend(q, ldq, rows, num_heads, num_kv_heads, d, (const uint16_t*)k_cache, (const uint16_t*)v_cache, ctx_slots,
               ctx_start, ctx_len, scale, out, threads);
    else
        attend(q, ldq, rows, num_heads, num_kv_heads, d, (const float*)k_cache, (const float*)v_cache, ctx_slots,
               ctx_start, ctx_len, scale, out, threads);
}

}  // extern "C"
