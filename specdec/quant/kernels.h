// The C ABI of the CPU kernels: every extern "C" entry point and the structs they share, declared once.
// Included by every .cpp here; the Python side's ctypes table (`kernel.py`: SIGNATURES and the
// Structure classes) follows it field by field, argument by argument (tests/test_quant.py checks it).
#pragma once
#include <stdint.h>

// One block of output features of a linear layer: packed codes (dense == null) or float32 weights.
struct Part {
    int64_t n;              // output features
    int bits;
    int group;
    int act;                // activation bits of the integer kernels (0, 8, 16)
    const void* codes;
    const float* scale;
    const float* offset;
    const float* dsup;
    const int8_t* sub;
    const uint8_t* mins;    // Q4_K under act 8: integer minimums (else null), with dmin per 256 values
    const float* dmin;
    const float* dense;     // [n, k] float32, or null
    const uint8_t* tiles;   // Q4_K, Q6_K, q4_64, q3_64 under act 8: row-interleaved tiles (tiles_rows16*.h), read instead
};

struct Linear {
    const Part* parts;
    int64_t num_parts;
    int64_t n;              // all parts' output features
    const float* bias;      // [n] or null
};

struct Layer {
    const float* input_norm;     // RMSNorm before attention, or null (a family with norms after it)
    const float* post_norm;      // RMSNorm before the MLP, or null
    const float* attn_out_norm;  // RMSNorm of attention's output before the residual add (OLMo 2), or null
    const float* mlp_out_norm;   // RMSNorm of the MLP's output before the residual add, or null
    const float* q_norm;    // [Dims.q_norm_len]: an RMSNorm over each such run of q before rope, or null
    const float* k_norm;    // [Dims.k_norm_len]: the same over k (null with q_norm)
    Linear qkv;
    Linear o;
    Linear gate_up;
    Linear down;
    void* k_cache;          // [num_kv_heads, Dims.kv_slots, row], rows in Dims.kv_format (kv_format.py)
    void* v_cache;
    int rope;               // 0: the layer attends without rotary embeddings (SmolLM3's every 4th)
};

struct Dims {
    int64_t hidden;
    int64_t intermediate;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t kv_slots;       // the K/V caches' slots per KV head
    float eps;
    float attn_scale;
    int kv_format;          // KV_FORMAT_*: the K/V caches' rows
    int64_t q_norm_len;     // the values each q norm runs over: head_dim (per head) or all of q; 0: none
    int64_t k_norm_len;
};

// One request's drafts (decoder.cpp's draft_chain): `steps` forwards, each picking one. The first
// feeds tokens[0, feed) (what the draft's cache lacks) at positions position onwards, every later one
// the last pick; pick s is written to tokens[feed + s]. The picks (draft_pick.h) are over the
// candidates, the output layer's columns then the own tokens: greedy at temperature 0; else over the
// processed logits (temperature, top-k, top-p, min-p, as logits_processors.py), the Gumbel-max with
// the request's positional noise (coupled: no uniform draws), or drawn from their softmax q.
struct ChainRow {
    int64_t feed;
    int64_t steps;
    int64_t position;
    const int64_t* slots;   // [position + feed + steps - 1] the cache slot of every position of the context
    int64_t* tokens;        // [feed + steps]
    Linear own;             // the output layer's rows of the request's own tokens (n == 0: none)
    const int64_t* own_ids; // [own.n] their token ids
    float temperature;
    float top_p;
    float min_p;
    int64_t top_k;          // 0: off
    int64_t noise_key;      // coupled: the request's noise key (sample/noise.py)
    int64_t noise_at;       // coupled: the output position of pick 0
    const double* uniform;  // drawn: [steps] uniform draws in [0, 1) of the request's generator (null: coupled)
    float* probs;           // drawn: [steps, vocab] zeros; each pick's q is written at its candidates' ids
    int64_t vocab;          // the sampled row's width (top-k applies below it; probs' width)
};

// One row of the verifier's under Gumbel coupling (picks.cpp): its processing (temperature, top-k with
// 0 for off, top-p, min-p, as logits_processors.py) and its noise's key and output position.
struct CoupledRow {
    float temperature;
    float top_p;
    float min_p;
    int64_t top_k;
    int64_t noise_key;
    int64_t position;
};

// K/V cache rows (kv_format.py): float32; float16 (IEEE half, rounded to nearest even); int8 codes then
// a float32 scale per group of kv_group(head_dim) values
#define KV_FORMAT_F32 0
#define KV_FORMAT_F16 1
#define KV_FORMAT_I8 2

inline int64_t kv_group(int64_t d) { return d % 32 == 0 ? 32 : d % 16 == 0 ? 16 : 8; }
inline int64_t kv_int8_row(int64_t d) { return d + 4 * (d / kv_group(d)); }  // bytes

// kernel_isa's instruction sets for the integer-activation paths (and attention: AVX-512 with VNNI's)
#define KERNEL_ISA_AVX2 0
#define KERNEL_ISA_VNNI 1

extern "C" {

// qlinear.cpp: linear layers (each documented at its definition)
int qlinear(const float* x, int64_t rows, int64_t k, int bits, int group, const void* codes, const float* scale,
            const float* offset, int64_t n, float* y, int64_t ldy, int threads, int act, const int8_t* sub,
            const float* dsup, const uint8_t* mins, const float* dmin, const uint8_t* tiles);
// The instruction set the integer-activation paths and attention use: request KERNEL_ISA_AVX2 or
// KERNEL_ISA_VNNI (the best the CPU has; the default), or -1 to ask. Returns the one in use.
int kernel_isa(int request);
int dense_linear(const float* x, int64_t rows, int64_t k, const float* w, int64_t n, float* y, int64_t ldy,
                 int threads);
int qlinear_parts(const float* x, int64_t rows, int64_t k, const Part* parts, int64_t num_parts, float* y,
                  int64_t ldy, int threads);
double int8_peak(int threads, double seconds);
double read_pass_seconds(const void* p, int64_t bytes, int threads);
void pack_tiles16(int bits, const uint8_t* codes, const int8_t* sub, const uint8_t* mins, const float* d,
                  const float* dmin, int64_t n, int64_t k, uint8_t* out);
void pack_tiles64(int bits, const uint8_t* codes, const float* scale, const float* offset, int64_t n, int64_t k, uint8_t* out);

// layer_ops.cpp: the decoder's glue
void rms_norm(float* x, int64_t ldx, const float* delta, int64_t ldd, int64_t rows, int64_t h, const float* w,
              float eps, float* out, int threads);
void rope(float* x, int64_t ldx, int64_t rows, int64_t heads, int64_t d, const int64_t* positions, const float* cos,
          const float* sin);
void qk_norms(float* x, int64_t ldx, int64_t rows, int64_t q_size, int64_t q_len, int64_t k_size, int64_t k_len,
              const float* q_norm, const float* k_norm, float eps, int threads);
void silu_mul(const float* x, int64_t rows, int64_t n, float* out, int threads);
// attention.cpp: paged attention
void attention(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
               int64_t kv_slots, const void* k_cache, const void* v_cache, const int64_t* ctx_slots,
               const int64_t* ctx_start, const int64_t* ctx_len, float scale, float* out, int threads, int kv_format);

// decoder.cpp: the layer loop in one call
int decoder_forward(const Layer* layers, int64_t num_layers, const Dims* dims, const float* final_norm, float* h,
                    int64_t rows, const int64_t* positions, const int64_t* slot_mapping, int64_t num_real,
                    const int64_t* ctx_slots, const int64_t* ctx_start, const int64_t* ctx_len, const float* cos,
                    const float* sin, float* out, int threads);
// The draft chain: each forward embeds the rows' tokens (`embed`: the table as a Part, float32 or
// 8-bit codes or 4-bit codes in 32-value chunks), runs the layer loop, scores `head` (columns
// `head_ids`, never-sample columns marked in `never`) and each row's own tokens at its last row, and
// picks (draft_pick.h). threads, seconds: [the longest row's steps], each forward's thread count, and
// its time written. Returns 0, or nonzero on an unsupported layout.
int draft_chain(const Layer* layers, int64_t num_layers, const Dims* dims, const float* final_norm,
                const Part* embed, const Linear* head, const int64_t* head_ids, const uint8_t* never,
                ChainRow* rows, int64_t num_rows, const float* cos, const float* sin, const int* threads,
                double* seconds);

// picks.cpp: each row of logits [rows, vocab] processed and picked by its Gumbel-max (draft_pick.h's
// coupled), into out[rows]; rows in parallel, each on one thread.
void coupled_picks(const float* logits, int64_t rows, int64_t vocab, const CoupledRow* params, int64_t* out,
                   int threads);

}  // extern "C"
