// The C entry points of the linear layers (kernels in qlinear.h and projection.h, built here for AVX2)
// and the choice of instruction set for the integer-activation paths.
#include <string.h>

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

inline void put_half(float v, uint8_t* at) {
    const uint16_t h = _cvtss_sh(v, 0);
    memcpy(at, &h, 2);
}

// Feature f's super-block of Q4_K into its tile o (codes: byte i of a group holds values i, 16 + i).
void pack_q4k(const uint8_t* codes, const int8_t* sub, const uint8_t* mins, float d, float dmin, int f, uint8_t* o) {
    put_half(d, o + kDAt + 2 * f);
    put_half(dmin, o + kDminAt + 2 * f);
    for (int g = 0; g < 8; ++g) {
        o[kSubAt + 16 * g + f] = (uint8_t)sub[g];
        o[kMinsAt + 32 * (g / 2) + 2 * f + g % 2] = mins[g];
        for (int b = 0; b < 16; ++b)  // run b / 4, value b % 4: the group's byte b as it is
            o[kCodesAt + 256 * g + 64 * (b / 4) + 4 * f + b % 4] = codes[16 * g + b];
    }
}

// Feature f's super-block of Q6_K into its tile o (codes in pack6's layout, two runs of 128 values).
void pack_q6k(const uint8_t* codes, const int8_t* sub, float d, int f, uint8_t* o) {
    put_half(d, o + kD6At + 2 * f);
    for (int g = 0; g < 16; ++g) o[32 * (g / 2) + 2 * f + g % 2] = (uint8_t)sub[g];
    for (int v = 0; v < 256; ++v) {
        const uint8_t* c = codes + 96 * (v / 128);
        const int e = v % 128;
        const int low = e < 64 ? c[e] & 0x0F : c[e - 64] >> 4, top = (c[64 + e % 32] >> (2 * (e / 32))) & 3;
        const int g = v / 16, run = (v % 16) / 4, at = 4 * f + v % 4;
        uint8_t* pair = o + kCodes6At + 384 * (g / 2);
        pair[64 * run + at] |= (uint8_t)(low << (4 * (g % 2)));
        pair[256 + 64 * (g % 2) + at] |= (uint8_t)(top << (2 * run));
    }
}

// Feature f's group of 64 3-bit codes (pack3's 24 bytes: bit pairs, then a 64-bit word of third bits)
// into its tile o.
void pack_g64_3(const uint8_t* c, int f, uint8_t* o) {
    uint64_t thirds;
    memcpy(&thirds, c + 16, 8);
    for (int v = 0; v < 64; ++v) {
        const int low = (c[v % 16] >> (2 * (v / 16))) & 3, run = v / 4, at = 4 * f + v % 4;
        o[kCodes64At + 64 * (run / 4) + at] |= (uint8_t)(low << (2 * (run % 4)));
        o[kThirds64At + 64 * (run / 8) + at] |= (uint8_t)(((thirds >> v) & 1) << (run % 8));
    }
}

// fill(o, j, s, f) for feature j, lane f of each tile slot s (a super-block or a group; `slots` a feature) of
// n features: the slot's tile o of `bytes`, zeroed first, so that a last tile's missing features stay zero.
template <class Fill>
void each_tile_slot(int64_t n, int64_t slots, int64_t bytes, uint8_t* out, Fill fill) {
    const int64_t tiles = (n + 15) / 16;
#pragma omp parallel for
    for (int64_t t = 0; t < tiles; ++t)
        for (int64_t s = 0; s < slots; ++s) {
            uint8_t* o = out + (t * slots + s) * bytes;
            memset(o, 0, bytes);
            for (int f = 0; f < 16 && t * 16 + f < n; ++f) fill(o, t * 16 + f, s, f);
        }
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

// Seconds for one read of `bytes` bytes at p on `threads` threads (peak.h): the read bandwidth's pass.
double read_pass_seconds(const void* p, int64_t bytes, int threads) {
    return read_pass((const uint8_t*)p, bytes, threads);
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
// super-block, summed in integers (offset is then not read). With tiles (act 8: Q4_K, Q6_K, q4_64, q3_64), the same
// weights row-interleaved (tiles_rows16.h, tiles_rows16_g64.h) are read instead.
// act 16: activations quantized to int16 per 256 values (precision int4-a16); needs sub and dsup.
// act 0: float32 activations (precision int4, weight-only).
int qlinear(const float* x, int64_t rows, int64_t k, int bits, int group, const void* codes,
            const float* scale, const float* offset, int64_t n, float* y, int64_t ldy, int threads, int act,
            const int8_t* sub, const float* dsup, const uint8_t* mins, const float* dmin, const uint8_t* tiles) {
    if (k % 32 || (act != 0 && act != 8 && act != 16)) return -1;
    if (act == 16 && !sub) return -1;  // int16: K-quant super-blocks only (decoder.py / packed.py route the rest)
    if (act) {
        const Part part{n, bits, group, act, codes, scale, offset, dsup, sub, mins, dmin, nullptr, tiles};
        return qlinear_parts(x, rows, k, &part, 1, y, ldy, threads);
    }
    if (bits == 4 && group == 32) run<4, 32>(x, rows, k, codes, scale, offset, n, y, ldy, threads);
    else if (bits == 8 && group == 32) run<8, 32>(x, rows, k, codes, scale, offset, n, y, ldy, threads);
    else if (bits == 6 && group == 16 && k % 128 == 0) run<6, 16>(x, rows, k, codes, scale, offset, n, y, ldy, threads);
    else return -1;
    return 0;
}

// A K-quant part's arrays as row-interleaved tiles (tiles_rows16.h): Q4_K (bits 4: codes [n, k / 2] as
// packed.py holds them, sub and mins [n, k / 32], d and dmin [n, k / 256]) or Q6_K (bits 6: codes
// [n, k * 3 / 4] in pack6's layout, sub [n, k / 16], d; mins and dmin null). d and dmin hold float16 values.
// out: ceil(n / 16) * (k / 256) tiles; the last tile's missing features are zero.
void pack_tiles16(int bits, const uint8_t* codes, const int8_t* sub, const uint8_t* mins, const float* d,
                  const float* dmin, int64_t n, int64_t k, uint8_t* out) {
    const int64_t supers = k / 256;
    each_tile_slot(n, supers, bits == 4 ? kRows16Bytes : kRows16Bytes6, out, [&](uint8_t* o, int64_t j, int64_t sb, int f) {
        if (bits == 4) pack_q4k(codes + j * (k / 2) + sb * 128, sub + j * (k / 32) + sb * 8, mins + j * (k / 32) + sb * 8,
                                d[j * supers + sb], dmin[j * supers + sb], f, o);
        else pack_q6k(codes + j * (k * 3 / 4) + sb * 192, sub + j * (k / 16) + sb * 16, d[j * supers + sb], f, o);
    });
}

// A draft's part requantized per 64 values (bits 4: codes [n, k / 2] as packed.py holds them, byte i of a
// 32-value block holding values i and 16 + i; bits 3: [n, k * 3 / 8] in pack3's layout; scale and offset
// [n, k / 64] float32 holding float16 values, offset may be null) as row-interleaved tiles (tiles_rows16_g64.h).
// out: ceil(n / 16) * (k / 64) tiles; the last tile's missing features are zero.
void pack_tiles64(int bits, const uint8_t* codes, const float* scale, const float* offset, int64_t n, int64_t k,
                  uint8_t* out) {
    const int64_t groups = k / 64;
    each_tile_slot(n, groups, kRows64Bytes[bits], out, [&](uint8_t* o, int64_t j, int64_t g, int f) {
        put_half(scale[j * groups + g], o + kScale64At + 2 * f);
        if (offset) put_half(offset[j * groups + g], o + kOffset64At + 2 * f);
        const uint8_t* c = codes + j * (k * bits / 8) + g * 8 * bits;
        if (bits == 3) pack_g64_3(c, f, o);
        else
            for (int b = 0; b < 32; ++b)  // half b / 16, run b % 16 / 4, value b % 4: the block's byte as it is
                o[kCodes64At + 256 * (b / 16) + 64 * (b % 16 / 4) + 4 * f + b % 4] = c[b];
    });
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
