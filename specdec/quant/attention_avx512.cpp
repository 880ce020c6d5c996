// attention.h built with AVX-512 (the build compiles this file alone with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni, as qlinear_vnni.cpp); attention.cpp calls it only where the CPU has them.
#include "attention.h"

void attention_avx512(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                      int64_t kv_slots, const void* k_cache, const void* v_cache, const int64_t* ctx_slots,
                      const int64_t* ctx_start, const int64_t* ctx_len, float scale, float* out, int threads,
                      int kv_format) {
    attend_format(q, ldq, rows, num_heads, num_kv_heads, d, kv_slots, k_cache, v_cache, ctx_slots, ctx_start,
                  ctx_len, scale, out, threads, kv_format);
}
