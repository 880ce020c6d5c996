// Picks on the C++ side: the draft chain's (decoder.cpp's draft_chain), greedy as the Python side
// takes the first maximum, or sampled over the request's processed logits (logits_processors.py's
// temperature, top-k, top-p, min-p), either the Gumbel-max with the target's positional noise
// (coupled, sample/noise.py) or a draw from their softmax q, q returned for rejection sampling; and the
// verifier's coupled rows (picks.cpp), the same processing and Gumbel-max over a target row. The
// processing need not match torch's bit for bit: a draft's q only needs to be the one it was drawn
// from, and a target row is picked by this code whether its step verifies drafts or not.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "simd.h"

namespace {

// numpy's argmax: the first NaN, else the first maximum; columns marked in `never` count as -inf.
int64_t first_max(const float* v, int64_t n, const uint8_t* never) {
    int64_t best = 0;
    float top = 0.f;
    for (int64_t c = 0; c < n; ++c) {
        const float x = never && never[c] ? -INFINITY : v[c];
        if (x != x) return c;
        if (c == 0 || x > top) top = x, best = c;
    }
    return best;
}

using simd::largest;

// f(c) for each c in [0, n), in order, with v[c] > floor (8 compared at a time).
template <class F>
void each_above(const float* v, int64_t n, float floor, F f) {
    const __m256 fl = _mm256_set1_ps(floor);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (unsigned m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + c), fl, _CMP_GT_OQ)); m; m &= m - 1)
            f(c + __builtin_ctz(m));
    for (; c < n; ++c)
        if (v[c] > floor) f(c);
}

// Whether (v, id) outranks (top, top_id) as draft_model._max_key orders picks: NaN first, then the
// larger logit, then the smaller id.
bool outranks(float v, int64_t id, float top, int64_t top_id) {
    const bool nan = v != v, top_nan = top != top;
    if (nan != top_nan) return nan;
    if (!nan && v != top) return v > top;
    return id < top_id;
}

// exp(x - top) of every value into e (0 for -inf), 8 at a time; returns their sum.
double exps(const std::vector<float>& x, float top, std::vector<float>& e) {
    const int64_t n = x.size();
    e.resize(n);
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 v = simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(&x[c]), t));
        _mm256_storeu_ps(&e[c], v);
        sum = _mm256_add_ps(sum, v);
    }
    double total = simd::hsum(sum);
    for (; c < n; ++c) total += (e[c] = expf(x[c] - top));
    return total;
}

struct Filters {
    std::vector<float> e, tmp;
    std::vector<int64_t> order;
    std::vector<uint8_t> keep;
};

constexpr float kTopPSpan = 20.f;  // e^-20: how far below the largest value top-p looks first

// top-p on x (in place): the values, largest first (ties by position), are kept while the probability
// mass before them is under top_p. Only the values within kTopPSpan of the largest are ordered first
// (all of them if those fall short of top_p: every one of them comes before every other value, so the
// kept set is the same), and of those only the largest m, m growing until they hold top_p.
void top_p_filter(std::vector<float>& x, float top_p, Filters& f) {
    const int64_t n = x.size();
    const float top = largest(x.data(), n);
    const double sum = exps(x, top, f.e);
    const auto larger = [&](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
    int64_t kept = 0;
    for (float span : {kTopPSpan, INFINITY}) {
        f.order.clear();
        for (int64_t c = 0; c < n; ++c)
            if (x[c] > -INFINITY && x[c] >= top - span) f.order.push_back(c);
        double before = 0.0;
        for (int64_t m = 256;; m *= 8) {
            const int64_t mm = std::min<int64_t>(m, f.order.size());
            std::partial_sort(f.order.begin(), f.order.begin() + mm, f.order.end(), larger);
            before = 0.0;
            for (kept = 0; kept < mm && before < top_p; ++kept) before += f.e[f.order[kept]] / sum;
            if (before >= top_p || mm == (int64_t)f.order.size()) break;
        }
        if (before >= top_p) break;
    }
    f.keep.assign(n, 0);
    for (int64_t j = 0; j < kept; ++j) f.keep[f.order[j]] = 1;
    for (int64_t c = 0; c < n; ++c)
        if (!f.keep[c]) x[c] = -INFINITY;
}

// logits_processors._filter on x (logits over the temperature, in place): top-k drops what is below
// the k-th largest of a row `vocab` wide, then top-p, then min-p drops probabilities under min_p
// times the largest. Dropped values become -inf.
void filter(std::vector<float>& x, int64_t top_k, float top_p, float min_p, int64_t vocab, Filters& f) {
    const int64_t n = x.size();
    if (top_k > 0 && top_k < vocab && top_k <= n) {  // the k-th largest: among those within kTopPSpan if k are
        const float low = largest(x.data(), n) - kTopPSpan;
        f.tmp.clear();
        each_above(x.data(), n, low, [&](int64_t c) { f.tmp.push_back(x[c]); });
        if ((int64_t)f.tmp.size() < top_k) f.tmp.assign(x.begin(), x.end());
        std::nth_element(f.tmp.begin(), f.tmp.begin() + (top_k - 1), f.tmp.end(), std::greater<float>());
        const float kth = f.tmp[top_k - 1];
        for (float& v : x)
            if (v < kth) v = -INFINITY;
    }
    if (top_p < 1.f) top_p_filter(x, top_p, f);
    if (min_p > 0.f) {  // p < min_p * p_max  <=>  x - top < log(min_p)
        const float cut = largest(x.data(), n) + logf(min_p);
        for (float& v : x)
            if (v < cut) v = -INFINITY;
    }
}

// q = softmax(x) in place (x holds a finite maximum).
void softmax(std::vector<float>& x, Filters& f) {
    const float top = largest(x.data(), x.size());
    const float scale = (float)(1.0 / exps(x, top, f.e));
    for (size_t c = 0; c < x.size(); ++c) x[c] = f.e[c] * scale;
}

// sample/noise.py's Gumbel value G of token `id` for base = mix(key ^ mix(position)): SplitMix64's
// output function of a counter, its top 53 bits as v in (0, 1), G = -log(-log1p(-v)) in float32. (The
// logarithms are the C library's, where torch's are its own: the native picks (picks.cpp) and the draft
// chain use these, the Python paths torch's. A last-bit difference could change a sampled token between
// a build with the kernels and one without, never between plain and speculative decoding in one.)
uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float uniform(uint64_t base, int64_t id) {
    const uint64_t bits = mix(base + (uint64_t)(id + 1) * 0x9E3779B97F4A7C15ull);
    return (float)(((double)(bits >> 11) + 0.5) * 0x1p-53);
}

float gumbel_of(float v) { return -logf(-log1pf(-v)); }

float gumbel(uint64_t base, int64_t id) { return gumbel_of(uniform(base, id)); }

constexpr float kGumbelMax = 37.5f;  // G's largest value, at v = 2^-54: 54 ln 2 = 37.43

// Whether x + G(v) < x + t is certain without G's logarithms: G falls as v rises, and G(v) >= t needs
// v <= 1 - exp(-exp(-t)), tabulated every 1/16 and read at the step at or below t - slack (slack: well
// above the float rounding of G and of the sum). Most values of an unfiltered row
// are several units below the best sum: their G is rejected on its uniform alone.
bool below(float v, float t, float slack) {
    constexpr int kSteps = 16, kSize = 40 * kSteps;
    static const std::vector<double> needed = [] {
        std::vector<double> out(kSize);
        for (int i = 0; i < kSize; ++i) out[i] = -expm1(-exp(-(double)i / kSteps));
        return out;
    }();
    const float at = (t - slack) * kSteps;
    if (!(at >= 0.f)) return false;
    return (double)v > needed[at >= kSize - 1 ? kSize - 1 : (int)at];
}

// The coupled pick: the first maximum of x + G over the values left (-inf excluded), G only where it
// can win: once the largest x has its G, a value needs x > that sum - kGumbelMax. id(c): candidate c's
// token id, whose noise it takes.
template <class Id>
int64_t coupled(const std::vector<float>& x, int64_t key, int64_t position, Id id) {
    const uint64_t base = mix((uint64_t)key ^ mix((uint64_t)position));
    const int64_t n = x.size();
    const float most = largest(x.data(), n);
    int64_t best = 0;  // the first maximum
    each_above(x.data(), n, std::nextafter(most, -INFINITY), [&](int64_t c) { best = x[best] == most ? best : c; });
    float top = x[best] + gumbel(base, id(best));
    const float floor = top - kGumbelMax;  // -inf where G was -inf: then every value is tried
    const float slack = 1e-3f + 1e-6f * (fabsf(most) + kGumbelMax);  // 8 float steps of any sum, and more
    each_above(x.data(), n, floor, [&](int64_t c) {
        if (c == best) return;
        const float u = uniform(base, id(c));
        if (below(u, top - x[c], slack)) return;  // x[c] + G < top: it cannot win
        const float v = x[c] + gumbel_of(u);
        if (v > top || (v == top && c < best)) top = v, best = c;
    });
    return best;
}

// The draw of uniform u in [0, 1) from q: the first candidate whose cumulative mass passes u times
// the whole (inverse transform sampling; candidates without mass are never drawn).
int64_t draw(const std::vector<float>& q, double u) {
    double total = 0.0;
    for (float v : q) total += v;
    const double target = u * total;
    double cum = 0.0;
    int64_t last = 0;
    for (int64_t c = 0; c < (int64_t)q.size(); ++c) {
        if (!(q[c] > 0.f)) continue;
        cum += q[c];
        last = c;
        if (cum > target) return c;
    }
    return last;
}

}  // namespace
