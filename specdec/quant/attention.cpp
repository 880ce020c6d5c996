// Paged attention (attention.h), the AVX2 build and the entry point: the AVX-512 build where the CPU has it.
#include "attention.h"

extern "C" {

// Causal attention of each query row over exactly its own context, read through the cache slots.
// q: [rows, num_heads, d] (row stride ldq); k_cache, v_cache: [num_kv_heads, kv_slots, row] (head-major:
// the thread that takes a KV head reads one stream, which the hardware prefetcher follows);
// ctx_slots: the slots of every row's context, row r's at ctx_slots[ctx_start[r] .. + ctx_len[r]];
// out: [rows, num_heads * d] contiguous. The num_heads / num_kv_heads query heads sharing a KV head
// are done together, and so are consecutive rows whose contexts extend one another (a verification's
// k + 1 rows): each block of 32 keys or values is read from memory once for all of them, then from the
// L1 cache; a key chunk is loaded once for two query heads (AVX-512: ten, of any rows of the run), a
// value chunk once for six. scores = q.k * scale; softmax with the maximum subtracted; out = sum_t p_t v_t,
// with p normalized first. Each output's operations are the same whatever it is grouped with. d a
// multiple of 8. kv_format: the caches' rows
// (KV_FORMAT_*, kv_format.py), widened to float32 as they are read.
void attention(const float* q, int64_t ldq, int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t d,
               int64_t kv_slots, const void* k_cache, const void* v_cache, const int64_t* ctx_slots,
               const int64_t* ctx_start, const int64_t* ctx_len, float scale, float* out, int threads, int kv_format) {
    if (kernel_isa(-1) == KERNEL_ISA_VNNI)
        attention_avx512(q, ldq, rows, num_heads, num_kv_heads, d, kv_slots, k_cache, v_cache, ctx_slots, ctx_start,
                         ctx_len, scale, out, threads, kv_format);
    else
        attend_format(q, ldq, rows, num_heads, num_kv_heads, d, kv_slots, k_cache, v_cache, ctx_slots, ctx_start,
                      ctx_len, scale, out, threads, kv_format);
}

}  // extern "C"
