// The C entry points of the linear layers (kernels in qlinear.h and projection.h, built here for AVX2)
// and the choice of instruction set for the integer-activation paths.
#include "peak.h"
#include "projection.h"

#include "kernels.h"

namespace {

// The integer paths run with VNNI where the CPU has it, unless kernel_isa asked for AVX2.
int& isa() {
    static int value = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return value;
}

}  // namespace

extern "C" {
int kernel_isa(int request) {
    static const int best = isa();
    if (request == KERNEL_ISA_AVX2) isa() = KERNEL_ISA_AVX2;
    else if (request == KERNEL_ISA_VNNI) isa() = best;
    return isa();
}

// The int8 multiply-add rate of the instructions the integer paths use now (kernel_isa), in multiply-adds
// a second on `threads` threads, each running independent chains for about `seconds` (peak.h).
double int8_peak(int threads, double seconds) {
    return isa() == KERNEL_ISA_VNNI ? int8_peak_vnni(threads, seconds) : int8_peak_rate(threads, seconds);
}

// x: [rows, k], w: [n, k], both float32 contiguous; y: rows of stride ldy, columns [0, n) written.
// Returns 0, or -1 when k is not a multiple of 8.
int dense_linear(const float* x, int64_t rows, int64_t k, const float* w, int64_t n, float* y, int64_t ldy,
                 int threads) {
    if (k % 8) return -1;
    dense(x, rows, k, w, n, y, ldy, threads);
    return 0;
}

// x: [rows, k] float32 contiguous; codes: [n, k * bits / 8] (bits 4, 6 or 8); scale, offset: [n, k / G]
// float32 (offset may be null); y: rows of stride ldy, columns [0, n) written. Returns 0, or -1 on a
// layout this build does not support.
// act 8: activations quantized to int8 per 32 values (precision int4-a8), integer dot products;
// with sub ([n, k / G] int8) and dsup ([n, k / 256]), scale = dsup * sub per super-block of 256 values
// (Q4_K: bits 4, group 32; Q6_K: bits 6, group 16) and x is quantized per 256 values instead.
// With mins ([n, k / 32] uint8) and dmin ([n, k / 256]) under act 8, Q4_K's offsets are -dmin * mins per
// super-block, summed in integers (offset is then not read).
// act 16: activations quantized to int16 per 256 values (precision int4-a16); needs sub and dsup.
// act 0: float32 activations (precision int4, weight-only).
int qlinear(const float* x, int64_t rows, int64_t k, int bits, int group, const void* codes,
            const float* scale, const float* offset, int64_t n, float* y, int64_t ldy, int threads, int act,
            const int8_t* sub, const float* dsup, const uint8_t* mins, const float* dmin) {
    if (k % 32 || (act != 0 && act != 8 && act != 16)) return -1;
    if (act == 16 && !sub) return -1;  // int16: K-quant super-blocks only (decoder.py / packed.py route the rest)
    if (act) {
        const Part part{n, bits, group, act, codes, scale, offset, dsup, sub, mins, dmin, nullptr};
        return qlinear_parts(x, rows, k, &part, 1, y, ldy, threads);
    }
    if (bits == 4 && group == 32) run<4, 32>(x, rows, k, codes, scale, offset, n, y, ldy, threads);
    else if (bits == 8 && group == 32) run<8, 32>(x, rows, k, codes, scale, offset, n, y, ldy, threads);
    else if (bits == 6 && group == 16 && k % 128 == 0) run<6, 16>(x, rows, k, codes, scale, offset, n, y, ldy, threads);
    else return -1;
    return 0;
}

// Every part of a fused projection (q|k|v, gate|up) in one call, parts side by side in y's columns
// from 0: x is rounded once for the parts that read it the same way, and the threads fork once. Parts
// with integer activations only (act 8 or 16; `qlinear`'s layouts). Returns 0, or -1 on another part.
int qlinear_parts(const float* x, int64_t rows, int64_t k, const Part* parts, int64_t num_parts, float* y,
                  int64_t ldy, int threads) {
    return (isa() == KERNEL_ISA_VNNI ? qlinear_parts_vnni : run_projection)(x, rows, k, parts, num_parts, y, ldy,
                                                                           threads);
}
}
