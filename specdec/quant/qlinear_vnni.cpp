// The integer-activation paths of qlinear.h and projection.h built with AVX-512 VNNI (the build compiles
// this file alone with -mavx512f -mavx512bw -mavx512vl -mavx512vnni); qlinear.cpp calls them only where
// the CPU has it.
#include "peak.h"
#include "projection.h"

int qlinear_parts_vnni(const float* x, int64_t rows, int64_t k, const Part* parts, int64_t num_parts, float* y,
                       int64_t ldy, int threads) {
    return run_projection(x, rows, k, parts, num_parts, y, ldy, threads);
}

double int8_peak_vnni(int threads, double seconds) { return int8_peak_rate(threads, seconds); }
