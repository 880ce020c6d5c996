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
    const float top = *std::max_element(x.begin(), x.end());
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
    if (top_k > 0 && top_k < vocab && top_k <= n) {
        f.tmp.assign(x.begin(), x.end());
        std::nth_element(f.tmp.begin(), f.tmp.begin() + (top_k - 1), f.tmp.end(), std::greater<float>());
        const float kth = f.tmp[top_k - 1];
        for (float& v : x)
            if (v < kth) v = -INFINITY;
    }
    if (top_p < 1.f) top_p_filter(x, top_p, f);
    if (min_p > 0.f) {  // p < min_p * p_max  <=>  x - top < log(min_p)
        const float cut = *std::max_element(x.begin(), x.end()) + logf(min_p);
        for (float& v : x)
            if (v < cut) v = -INFINITY;
    }
}

// q = softmax(x) in place (x holds a finite maximum).
void softmax(std::vector<float>& x, Filters& f) {
    const float top = *std::max_element(x.begin(), x.end());
    const float scale = (float)(1.0 / exps(x, top, f.e));
    for (size_t c = 0; c < x.size(); ++c) x[c] = f.e[c] * scale;
}

// sample/noise.py's Gumbel value G of token `id` for base = mix(key ^ mix(position)): SplitMix64's
// output function of a counter, its top 53 bits as v in (0, 1), G = -log(-log1p(-v)) in float32. (The
// logarithms are the C library's, where torch's are its own: a last-bit difference could only change
// which draft is proposed, never what is accepted.)
uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float gumbel(uint64_t base, int64_t id) {
    const uint64_t bits = mix(base + (uint64_t)(id + 1) * 0x9E3779B97F4A7C15ull);
    const float v = (float)(((double)(bits >> 11) + 0.5) * 0x1p-53);
    return -logf(-log1pf(-v));
}

constexpr float kGumbelMax = 37.5f;  // G's largest value, at v = 2^-54: 54 ln 2 = 37.43

// The coupled pick: the first maximum of x + G over the values left (-inf excluded), G only where it
// can win: once the largest x has its G, a value needs x > that sum - kGumbelMax. id(c): candidate c's
// token id, whose noise it takes.
template <class Id>
int64_t coupled(const std::vector<float>& x, int64_t key, int64_t position, Id id) {
    const uint64_t base = mix((uint64_t)key ^ mix((uint64_t)position));
    const int64_t n = x.size();
    int64_t best = std::max_element(x.begin(), x.end()) - x.begin();
    float top = x[best] + gumbel(base, id(best));
    const float floor = top - kGumbelMax;  // -inf where G was -inf: then every value is tried
    for (int64_t c = 0; c < n; ++c) {
        if (!(x[c] > floor) || c == best) continue;
        const float v = x[c] + gumbel(base, id(c));
        if (v > top || (v == top && c < best)) top = v, best = c;
    }
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
