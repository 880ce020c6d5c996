// Linear layers for x86 CPUs, y[r, j] = sum_k x[r, k] * w[j, k]: the kernels themselves, included by two
// translation units. qlinear.cpp builds them for AVX2 (every x86-64 CPU the package supports) and holds
// the C entry points; qlinear_vnni.cpp builds the integer-activation paths again with AVX-512 VNNI, whose
// dot-product instructions replace two or three AVX2 instructions each (`#ifdef __AVX512VNNI__` below).
// Both compute the same exact integer sums and the same float operations in the same order, so they are
// bitwise equal: which one runs depends only on the CPU (kernel_isa), never on the batch.
//
// Weight-only quantized: w is stored
// per group of G input values as integer codes q with a float scale and an optional float offset:
// w = scale * q + offset (exactly how GGUF's Q4_K / Q5_0 / Q6_K / Q8_0 blocks decode). Dense float32
// weights (precision float32) at the end.
//
// Batch invariance by construction: every output element is reduced in the same order whatever the
// number of rows, so a token's result never depends on what else shares the forward. Rows are
// processed in tiles so that each group's codes are decoded once per tile, not once per row.
#pragma once

// By concept, each its own header:
#include "tiles_common.h"     // shared helpers, threads, row blocks and tiles
#include "tiles_float_x.h"    // float32 activations
#include "quantize_x.h"       // activation quantization (int8, int16)
#include "tiles_rows16.h"     // int8 activations: K-quant super-blocks, row-interleaved
#include "tiles_group_x.h"    // int8 activations: per-group scales (per 32 or 64 values)
#include "tiles_int16_x.h"    // int16 activations: K-quant super-blocks
#include "dense.h"            // dense float32 weights
