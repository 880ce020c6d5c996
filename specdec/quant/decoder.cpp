// The decoder's layer loop in one call: for each layer, RMSNorm (with the residual add), q|k|v,
// rotary embeddings, the K/V write into the paged cache, attention, o, RMSNorm, gate|up, SiLU·up,
// down. From Python the same loop made about 300 kernel calls a token, and their Python and ctypes
// overhead cost more than attention's arithmetic. Every step calls the same kernels as the Python loop
// (`llama.py`), in the same order, on the same rows: the results are bitwise the same.
#include <stdint.h>
#include <string.h>

#include <vector>

extern "C" {
int qlinear(const float* x, int64_t rows, int64_t k, int bits, int group, const void* codes, const float* scale,
            const float* offset, int64_t n, float* y, int64_t ldy, int threads, int act, const int16_t* sub,
            const float* dsup);
int dense_linear(const float* x, int64_t rows, int64_t k, const float* w, int64_t n, float* y, int64_t ldy,
                 int threads);
void rms_norm(float* x, int64_t ldx, const float* delta, int64_t ldd, int64_t rows, int64_t h, const float* w,
              float eps, float* out, int threads);
void rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t d, const int64_t* positions, const float* cos,
          const float* sin);
void silu_mul(const float* x, int64_t rows, int64_t n, float* out, int threads);
void attention(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
               const float* k_cache, const float* v_cache, const int64_t* ctx_slots, const int64_t* ctx_start,
               const int64_t* ctx_len, float scale, float* out, int threads);
}

// One block of output features of a linear layer: packed codes (dense == null) or float32 weights.
struct Part {
    int64_t n;                          // output features
    int bits, group, act;                // act: activation bits of the integer kernels (0, 8, 16)
    const void* codes;
    const float *scale, *offset, *dsup;
    const int16_t* sub;
    const float* dense;                 // [n, k] float32, or null
};

struct Linear {
    const Part* parts;
    int64_t num_parts, n;               // n: all parts' output features
    const float* bias;                  // [n] or null
};

struct Layer {
    const float *input_norm, *post_norm;
    Linear qkv, o, gate_up, down;
    float *k_cache, *v_cache;           // [slots, num_kv_heads, head_dim]
};

struct Dims {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, attn_scale;
};

namespace {

// y[:, :n] = x @ W.T (+ bias), each part into its own columns. Returns nonzero on an unsupported layout.
int linear(const Linear& l, const float* x, int64_t rows, int64_t k, float* y, int threads) {
    int64_t col = 0;
    for (int64_t p = 0; p < l.num_parts; ++p) {
        const Part& part = l.parts[p];
        int rc = part.dense
                     ? dense_linear(x, rows, k, part.dense, part.n, y + col, l.n, threads)
                     : qlinear(x, rows, k, part.bits, part.group, part.codes, part.scale, part.offset, part.n,
                               y + col, l.n, threads, part.act, part.sub, part.dsup);
        if (rc) return rc;
        col += part.n;
    }
    if (l.bias)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < l.n; ++j) y[r * l.n + j] += l.bias[j];
    return 0;
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
        rms_norm(h, hd, have_delta ? delta.data() : nullptr, hd, rows, hd, L.input_norm, D.eps, x.data(), threads);
        if (int rc = linear(L.qkv, x.data(), rows, hd, qkv.data(), threads)) return rc;
        rope(qkv.data(), qkv_size, rows, D.num_heads + D.num_kv_heads, d, positions, cos, sin);
        for (int64_t r = 0; r < num_real; ++r) {
            memcpy(L.k_cache + slot_mapping[r] * kv_size, qkv.data() + r * qkv_size + q_size, kv_size * sizeof(float));
            memcpy(L.v_cache + slot_mapping[r] * kv_size, qkv.data() + r * qkv_size + q_size + kv_size,
                   kv_size * sizeof(float));
        }
        attention(qkv.data(), qkv_size, rows, D.num_heads, D.num_kv_heads, d, L.k_cache, L.v_cache, ctx_slots,
                  ctx_start, ctx_len, D.attn_scale, attn.data(), threads);
        if (int rc = linear(L.o, attn.data(), rows, q_size, delta.data(), threads)) return rc;
        rms_norm(h, hd, delta.data(), hd, rows, hd, L.post_norm, D.eps, x.data(), threads);
        if (int rc = linear(L.gate_up, x.data(), rows, hd, gate_up.data(), threads)) return rc;
        silu_mul(gate_up.data(), rows, D.intermediate, act.data(), threads);
        if (int rc = linear(L.down, act.data(), rows, D.intermediate, delta.data(), threads)) return rc;
        have_delta = true;
    }
    rms_norm(h, hd, have_delta ? delta.data() : nullptr, hd, rows, hd, final_norm, D.eps, out, threads);
    return 0;
}

}  // extern "C"
