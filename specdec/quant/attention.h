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
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "attention_kv.h"
#include "attention_tiles.h"
#include "kernels.h"

namespace {

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

#ifdef __AVX512F__
// A run's (row, head pair) items for qk_pairs16, row after row: the pair's queries and its two heads'
// score rows.
struct PairItems {
    std::vector<const float*> q;
    std::vector<float*> s0, s1;
    PairItems() = default;
    PairItems(const float* qp, int64_t r0, int64_t r1, int64_t pairs, int64_t d, const int64_t* ctx_len,
              std::vector<std::vector<float>>& scores) {
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t p = 0; p < pairs; ++p) {
                q.push_back(qp + ((r - r0) * pairs + p) * 2 * d);
                s0.push_back(scores[r - r0].data() + 2 * p * ctx_len[r]);
                s1.push_back(s0.back() + ctx_len[r]);
            }
    }
};

// Head pairs a key chunk is loaded for: 20 accumulators, 4 key chunks and a query in the 32 registers (a
// five-row verification of the 1.5B: 15 pairs, three loads of each chunk).
constexpr int kPairTile = 5;

// In the block at t0, every four keys that whole rows reach, scored for every head pair of those rows,
// up to kPairTile items at a time (qk_pairs16: each key chunk loaded once for all of them).
template <class Rows>
void paired_scores(const PairItems& items, int64_t r0, int64_t r1, int64_t pairs, int64_t t0, int64_t d,
                   const Rows& keys, const int64_t* ctx_len, float scale) {
    const int64_t end = std::min(t0 + kTokenBlock, ctx_len[r1 - 1]), stride_bytes = keys.stride * sizeof(*keys.cache);
    const int64_t n = (int64_t)items.q.size();
    int64_t rb = r0;  // the first row reaching the four keys (a run's contexts grow)
    for (int64_t t = t0; t + 4 <= end; t += 4) {
        for (int j = 0; j < 4; ++j)
            for (int64_t b = 0; b < stride_bytes; b += 64) keys.ahead(t + j, b);
        while (ctx_len[rb] < t + 4) ++rb;
        for (int64_t i = (rb - r0) * pairs; i < n; i += kPairTile) {
            float* out[2 * kPairTile];
            const int64_t m = std::min<int64_t>(kPairTile, n - i);
            for (int64_t u = 0; u < m; ++u) out[2 * u] = items.s0[i + u] + t, out[2 * u + 1] = items.s1[i + u] + t;
            simd::with_count<kPairTile>(m, [&](auto np) {
                qk_pairs16<decltype(np)::value>(items.q.data() + i, keys, t, d, scale, out);
            });
        }
    }
}
#endif

// Row scores sc ([group, len]) of queries qh over keys [t0, t1), but the head pairs' keys before `paired`
// (scored by paired_scores): query heads in pairs (a last one alone), up to four keys at once. bring: ask
// for the rows' lines ahead (the run's first row).
template <class Rows>
void row_scores(const float* qh, float* sc, int64_t len, int64_t group, int64_t d, const Rows& keys, int64_t t0,
                int64_t paired, int64_t t1, bool bring, float scale) {
    const int64_t stride_bytes = keys.stride * (int64_t)sizeof(*keys.cache);
    for (int64_t g = 0; g < group; g += 2) {
        const int64_t nh = std::min<int64_t>(2, group - g);
        const float* qs[2] = {qh + g * d, qh + (g + nh - 1) * d};
        for (int64_t t = nh == 2 ? paired : t0; t < t1;) {
            const int64_t nk = std::min<int64_t>(8 / nh, t1 - t);
            const float* ks[8];
            float* out[2] = {sc + g * len + t, sc + (g + nh - 1) * len + t};
            for (int j = 0; j < nk; ++j) ks[j] = keys.row(t + j);
            if (bring && g == 0)
                for (int j = 0; j < nk; ++j)
                    for (int64_t b = 0; b < stride_bytes; b += 64) keys.ahead(t + j, b);
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
}

// Scores of rows [r0, r1) (each against its own context) for one KV head's query heads, block by block:
// with AVX-512 every row's head pairs four keys at a time (paired_scores), then what is left row by row.
// scores[i]: [group, ctx_len[r0 + i]].
template <class Rows>
void run_scores(const float* q, int64_t ldq, int64_t r0, int64_t r1, int64_t group, int64_t kvh, int64_t d,
                Rows& keys, const int64_t* ctx_len, float scale, std::vector<std::vector<float>>& scores) {
    const int64_t pairs = group / 2;
#ifdef __AVX512F__
    std::vector<float> qp(pairs <= 4 ? (r1 - r0) * pairs * 2 * d : 0);
    for (int64_t r = r0; !qp.empty() && r < r1; ++r)
        pair_queries(q + r * ldq + kvh * group * d, pairs, d, qp.data() + (r - r0) * pairs * 2 * d);
    const PairItems items = qp.empty() ? PairItems() : PairItems(qp.data(), r0, r1, pairs, d, ctx_len, scores);
#endif
    for (int64_t t0 = 0; t0 < ctx_len[r1 - 1]; t0 += kTokenBlock) {
        keys.begin(t0, std::min(t0 + kTokenBlock, keys.end));
        keys.plan(t0);
        bool fours = false;  // whether each row's head pairs have scored the block's whole fours of keys
#ifdef __AVX512F__
        fours = !items.q.empty();
        if (fours) paired_scores(items, r0, r1, pairs, t0, d, keys, ctx_len, scale);
#endif
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t len = ctx_len[r], t1 = std::min(t0 + kTokenBlock, len);
            if (t0 < t1)
                row_scores(q + r * ldq + kvh * group * d, scores[r - r0].data(), len, group, d, keys, t0,
                           fours ? t0 + (t1 - t0) / 4 * 4 : t0, t1, r == r0, scale);
        }
    }
}

// acc[i] ([group, d]) = the probabilities of rows [r0, r1) times the values, read through `values`; each output sums over t in order, as one pass would, in registers over a block.
template <class Rows>
void run_values(int64_t r0, int64_t r1, int64_t group, int64_t d, Rows& values, const int64_t* ctx_len,
                const std::vector<std::vector<float>>& scores, std::vector<std::vector<float>>& acc) {
    blocks_of_run(r0, r1, ctx_len, [&](int64_t r, int64_t t0, int64_t t1) {
        values.begin(t0, std::min(t0 + kTokenBlock, values.end));
        values.plan(t0);
#ifdef __AVX512F__
        decltype(row_at(values, t0)) rows[kTokenBlock];  // looked up once for every head and chunk
        for (int64_t t = t0; t < t1; ++t) rows[t - t0] = row_at(values, t);
#endif
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
                for (; i0 + 64 <= d; i0 += 64) pv_tile16<NH, 4>(ps, values, rows, i0, t0, t1, accs, first);
                for (; i0 + 16 <= d; i0 += 16) pv_tile16<NH, 1>(ps, values, rows, i0, t0, t1, accs, first);
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
            KvRows<T> k_rows{{keys, slots, d, stride, ctx_len[r1 - 1]}}, v_rows{{values, slots, d, stride, ctx_len[r1 - 1]}};
            run_scores(q, ldq, r0, r1, group, kvh, d, k_rows, ctx_len, scale, scores);
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t g = 0; g < group; ++g) softmax_(scores[r - r0].data() + g * ctx_len[r], ctx_len[r]);
            run_values(r0, r1, group, d, v_rows, ctx_len, scores, acc);
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
