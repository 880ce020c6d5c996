// The decoder's layer loop in one call: for each layer, RMSNorm (with the residual add), q|k|v,
// q/k norms where the family has them, rotary embeddings (on the layers that have them), the K/V
// write into the paged cache, attention, o, RMSNorm, gate|up, SiLU·up, down; a post-norm family
// norms attention's and the MLP's outputs before the residual adds instead. From Python the same
// loop made about 300 kernel calls a token, and their Python and ctypes overhead cost more than
// attention's arithmetic. Every step calls the same kernels as the Python loop (`llama.py`), in the
// same order, on the same rows: the results are bitwise the same.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include <algorithm>

#include <vector>

#include "draft_pick.h"
#include "kernels.h"

namespace {

bool integer_parts(const Linear& l) {
    for (int64_t p = 0; p < l.num_parts; ++p)
        if (l.parts[p].dense || !l.parts[p].act) return false;
    return true;
}

// Part by part, each into its own columns (float32 weights, weight-only int4).
int each_part(const Linear& l, const float* x, int64_t rows, int64_t k, float* y, int threads) {
    int64_t col = 0;
    for (int64_t p = 0; p < l.num_parts; ++p) {
        const Part& part = l.parts[p];
        int rc = part.dense
                     ? dense_linear(x, rows, k, part.dense, part.n, y + col, l.n, threads)
                     : qlinear(x, rows, k, part.bits, part.group, part.codes, part.scale, part.offset, part.n,
                               y + col, l.n, threads, part.act, part.sub, part.dsup, part.mins, part.dmin,
                               part.tiles);
        if (rc) return rc;
        col += part.n;
    }
    return 0;
}

// y[:, :n] = x @ W.T (+ bias): with integer activations all parts in one call (x rounded once, one
// fork), else part by part. Returns nonzero on an unsupported layout.
int linear(const Linear& l, const float* x, int64_t rows, int64_t k, float* y, int threads) {
    int rc = integer_parts(l) ? qlinear_parts(x, rows, k, l.parts, l.num_parts, y, l.n, threads)
                              : each_part(l, x, rows, k, y, threads);
    if (rc) return rc;
    if (l.bias)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < l.n; ++j) y[r * l.n + j] += l.bias[j];
    return 0;
}

// n values of one row's K or V into the cache at element `at`: as they are, or rounded to float16
// (nearest even, as torch's .half()). n a multiple of 8.
// x: one token's K or V, [num_kv_heads, d], into `slot` of a [num_kv_heads, slots, row] cache, each
// head's row in Dims.kv_format with kv_format.py's arithmetic: float16 rounded to nearest even as torch's
// .half(); int8 codes round-half-even(x / scale), scale = max|x| / 127 per group of kv_group(d)
// values, then the scales' bytes.
void store_kv(void* cache, int64_t slot, const float* x, const Dims& D) {
    const int64_t d = D.head_dim;
    for (int64_t h = 0; h < D.num_kv_heads; ++h) {
        const float* src = x + h * d;
        if (D.kv_format == KV_FORMAT_F32) {
            memcpy((float*)cache + (h * D.kv_slots + slot) * d, src, d * sizeof(float));
        } else if (D.kv_format == KV_FORMAT_F16) {
            uint16_t* out = (uint16_t*)cache + (h * D.kv_slots + slot) * d;
            for (int64_t i = 0; i < d; i += 8)
                _mm_storeu_si128((__m128i*)(out + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        } else {
            const int64_t group = kv_group(d);
            int8_t* out = (int8_t*)cache + (h * D.kv_slots + slot) * kv_int8_row(d);
            for (int64_t g = 0; g < d / group; ++g) {
                const float* xg = src + g * group;
                float amax = 0.f;
                for (int64_t i = 0; i < group; ++i) amax = std::max(amax, fabsf(xg[i]));
                const float scale = amax / 127.f;
                for (int64_t i = 0; i < group; ++i)  // nearbyintf: the current rounding, to nearest even
                    out[g * group + i] =
                        scale > 0.f ? (int8_t)std::min(127.f, std::max(-127.f, nearbyintf(xg[i] / scale))) : 0;
                memcpy(out + d + 4 * g, &scale, 4);
            }
        }
    }
}

// Row `id` of an embedding table (a Part of e.n rows of k values) into out: float32 rows as they are,
// else code * scale (+ offset) per group in float32, two roundings as packed.py's dequantize. 8-bit
// codes one a byte; 4-bit in 32-value chunks of 16 bytes, low nibbles first (packed.py's int_codes).
int embed_row(const Part& e, int64_t k, int64_t id, float* out) {
    if (id < 0 || id >= e.n) return 2;
    if (e.dense) {
        memcpy(out, e.dense + id * k, k * sizeof(float));
        return 0;
    }
    const float* scale = e.scale + id * (k / e.group);
    if (e.bits == 8) {
        const int8_t* c = (const int8_t*)e.codes + id * k;
        for (int64_t i = 0; i < k; ++i) out[i] = (float)c[i] * scale[i / e.group];
    } else if (e.bits == 4 && k % 32 == 0) {
        const uint8_t* c = (const uint8_t*)e.codes + id * (k / 2);
        for (int64_t i = 0; i < k; ++i) {
            const uint8_t b = c[i / 32 * 16 + i % 16];
            out[i] = (float)(i % 32 < 16 ? b & 15 : b >> 4) * scale[i / e.group];
        }
    } else {
        return 1;
    }
    if (e.offset)
        for (int64_t i = 0; i < k; ++i) out[i] = out[i] + e.offset[id * (k / e.group) + i / e.group];
    return 0;
}

// h += RMSNorm(y) with weight w (a sublayer's output normed before the residual add, OLMo 2's order);
// scratch: [rows, hd]. The add is the plain float sum, as PyTorch's add_.
void add_normed(float* h, const float* y, int64_t rows, int64_t hd, const float* w, float eps, float* scratch,
                int threads) {
    rms_norm(const_cast<float*>(y), hd, nullptr, 0, rows, hd, w, eps, scratch, threads);
    for (int64_t i = 0; i < rows * hd; ++i) h[i] += scratch[i];
}

// Scratch of a row's pick, kept across the chain's forwards.
struct PickScratch {
    std::vector<float> own, x;
    Filters filters;
};

// Row `s` of the chain's pick from its final hidden state. Greedy (temperature 0): the head's first
// maximum, or the request's own token that outranks it. Sampled: the candidates' (head columns, then
// own tokens; never-sample columns at -inf) processed logits, and their Gumbel-max with the request's
// positional noise (coupled: no uniform draws), or the draw from their softmax q, written into the
// row's probs at their ids below its vocabulary.
int64_t pick(const float* logits, const Linear& head, const int64_t* head_ids, const uint8_t* never,
             const ChainRow& row, int64_t s, const float* hidden, int64_t k, PickScratch& w, int threads) {
    const int64_t nh = head.n, no = row.own.n;
    w.own.resize(no);
    if (no && linear(row.own, hidden, 1, k, w.own.data(), threads)) return -1;
    if (row.temperature == 0.f) {
        const int64_t c = first_max(logits, nh, never);
        const float top = never && never[c] ? -INFINITY : logits[c];
        if (no == 0) return head_ids[c];
        const int64_t j = first_max(w.own.data(), no, nullptr);
        return outranks(w.own[j], row.own_ids[j], top, head_ids[c]) ? row.own_ids[j] : head_ids[c];
    }
    const auto id = [&](int64_t c) { return c < nh ? head_ids[c] : row.own_ids[c - nh]; };
    w.x.resize(nh + no);
    for (int64_t c = 0; c < nh; ++c) w.x[c] = never && never[c] ? -INFINITY : logits[c] / row.temperature;
    for (int64_t j = 0; j < no; ++j) w.x[nh + j] = w.own[j] / row.temperature;
    filter(w.x, row.top_k, row.top_p, row.min_p, row.vocab, w.filters);
    if (!row.uniform) return id(coupled(w.x, row.noise_key, row.noise_at + s, id));
    softmax(w.x, w.filters);
    float* probs = row.probs + s * row.vocab;
    for (int64_t c = 0; c < nh + no; ++c)
        if (id(c) < row.vocab) probs[id(c)] = w.x[c];
    return id(draw(w.x, row.uniform[s]));
}

}  // namespace

extern "C" {

// h: [rows, hidden] the embedded tokens, updated in place as the residual stream; out: [rows, hidden]
// the final-normed hidden states. positions: [rows]; slot_mapping: [num_real] where each real row's
// K/V goes; ctx_*: every row's context as in `attention`. Returns 0, or nonzero on a layout `qlinear`
// does not support (the Python side checks every layout when it builds the descriptors, so never).
int decoder_forward(const Layer* layers, int64_t num_layers, const Dims* dims, const float* final_norm, float* h,
                    int64_t rows, const int64_t* positions, const int64_t* slot_mapping, int64_t num_real,
                    const int64_t* ctx_slots, const int64_t* ctx_start, const int64_t* ctx_len, const float* cos,
                    const float* sin, float* out, int threads) {
    const Dims& D = *dims;
    const int64_t hd = D.hidden, d = D.head_dim, q_size = D.num_heads * d, kv_size = D.num_kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size;
    std::vector<float> x(rows * hd), qkv(rows * qkv_size), attn(rows * q_size), gate_up(rows * 2 * D.intermediate),
        act(rows * D.intermediate), delta(rows * hd);
    bool have_delta = false;  // the last layer's MLP output, added to h by the next norm
    for (int64_t n = 0; n < num_layers; ++n) {
        const Layer& L = layers[n];
        const float* in = h;  // without a norm before attention (OLMo 2), the residual stream itself
        if (L.input_norm) {
            rms_norm(h, hd, have_delta ? delta.data() : nullptr, hd, rows, hd, L.input_norm, D.eps, x.data(), threads);
            in = x.data();
        }
        if (int rc = linear(L.qkv, in, rows, hd, qkv.data(), threads)) return rc;
        if (L.q_norm)
            qk_norms(qkv.data(), qkv_size, rows, q_size, D.q_norm_len, kv_size, D.k_norm_len, L.q_norm, L.k_norm, D.eps,
                     threads);
        if (L.rope) rope(qkv.data(), qkv_size, rows, D.num_heads + D.num_kv_heads, d, positions, cos, sin);
        for (int64_t r = 0; r < num_real; ++r) {
            const float* kv = qkv.data() + r * qkv_size + q_size;
            store_kv(L.k_cache, slot_mapping[r], kv, D);
            store_kv(L.v_cache, slot_mapping[r], kv + kv_size, D);
        }
        attention(qkv.data(), qkv_size, rows, D.num_heads, D.num_kv_heads, d, D.kv_slots, L.k_cache, L.v_cache,
                  ctx_slots, ctx_start, ctx_len, D.attn_scale, attn.data(), threads, D.kv_format);
        if (int rc = linear(L.o, attn.data(), rows, q_size, delta.data(), threads)) return rc;
        in = h;
        if (L.post_norm) {
            rms_norm(h, hd, delta.data(), hd, rows, hd, L.post_norm, D.eps, x.data(), threads);
            in = x.data();
        } else {
            add_normed(h, delta.data(), rows, hd, L.attn_out_norm, D.eps, x.data(), threads);
        }
        if (int rc = linear(L.gate_up, in, rows, hd, gate_up.data(), threads)) return rc;
        silu_mul(gate_up.data(), rows, D.intermediate, act.data(), threads);
        if (int rc = linear(L.down, act.data(), rows, D.intermediate, delta.data(), threads)) return rc;
        have_delta = L.mlp_out_norm == nullptr;  // else added now; a pre-norm family adds it in the next norm
        if (!have_delta) add_normed(h, delta.data(), rows, hd, L.mlp_out_norm, D.eps, x.data(), threads);
    }
    rms_norm(h, hd, have_delta ? delta.data() : nullptr, hd, rows, hd, final_norm, D.eps, out, threads);
    return 0;
}

// Forward s runs the requests with more than s steps, in order, each feeding its rows of the forward
// (all of `feed` in the first, then its last pick); contexts are the slot lists laid end to end, as
// `attention` reads them, and only each request's last row is scored.
int draft_chain(const Layer* layers, int64_t num_layers, const Dims* dims, const float* final_norm,
                const Part* embed, const Linear* head, const int64_t* head_ids, const uint8_t* never,
                ChainRow* rows, int64_t num_rows, const float* cos, const float* sin, const int* threads,
                double* seconds) {
    const int64_t hd = dims->hidden;
    int64_t steps = 0, most = 0;  // forwards; rows of the largest (the first)
    std::vector<int64_t> ctx_slots, offset(num_rows);
    for (int64_t r = 0; r < num_rows; ++r) {
        steps = std::max(steps, rows[r].steps);
        most += rows[r].feed;
        offset[r] = ctx_slots.size();
        ctx_slots.insert(ctx_slots.end(), rows[r].slots,
                         rows[r].slots + rows[r].position + rows[r].feed + rows[r].steps - 1);
    }
    std::vector<float> h(most * hd), out(most * hd), last(num_rows * hd), logits(num_rows * head->n);
    PickScratch scratch;
    std::vector<int64_t> who(num_rows), pos(most), slot(most), start(most), len(most);
    for (int64_t s = 0; s < steps; ++s) {
        const double t0 = omp_get_wtime();
        int64_t n = 0, m = 0;  // requests, rows
        for (int64_t r = 0; r < num_rows; ++r) {
            const ChainRow& row = rows[r];
            if (row.steps <= s) continue;
            const int64_t first = s == 0 ? 0 : row.feed + s - 1, feed = s == 0 ? row.feed : 1;
            for (int64_t j = first; j < first + feed; ++j, ++m) {
                if (int rc = embed_row(*embed, hd, row.tokens[j], h.data() + m * hd)) return rc;
                pos[m] = row.position + j, slot[m] = row.slots[pos[m]], start[m] = offset[r], len[m] = pos[m] + 1;
            }
            who[n++] = r;
        }
        if (int rc = decoder_forward(layers, num_layers, dims, final_norm, h.data(), m, pos.data(), slot.data(), m,
                                     ctx_slots.data(), start.data(), len.data(), cos, sin, out.data(), threads[s]))
            return rc;
        for (int64_t i = 0, end = 0; i < n; ++i) {  // each request's last row
            const ChainRow& row = rows[who[i]];
            end += s == 0 ? row.feed : 1;
            memcpy(last.data() + i * hd, out.data() + (end - 1) * hd, hd * sizeof(float));
        }
        if (int rc = linear(*head, last.data(), n, hd, logits.data(), threads[s])) return rc;
        for (int64_t i = 0; i < n; ++i) {
            const ChainRow& row = rows[who[i]];
            const int64_t token = pick(logits.data() + i * head->n, *head, head_ids, never, row, s,
                                       last.data() + i * hd, hd, scratch, threads[s]);
            if (token < 0) return 1;
            row.tokens[row.feed + s] = token;
        }
        seconds[s] = omp_get_wtime() - t0;
    }
    return 0;
}

}  // extern "C"
